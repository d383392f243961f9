"""Packaging (SPEC §2): a real wheel, installed non-editable into a fresh venv, finds its Lua
scripts and runs ``quota-proxy`` from outside the checkout. And the Dockerfile, which no
engine builds here, checked for what the image must be.

The wheel is built offline with the interpreter's own hatchling when it has one
(``--no-build-isolation``); otherwise pip fetches the build backend from the index.
"""

from __future__ import annotations

import asyncio
import configparser
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import proxy
from proxy.limiter.scripts import NAMES
from proxy.policy import parse_policy
from tests.conftest import free_port, vendor_policy
from tests.helpers.cli import EXAMPLE, ROOT, clean_env, run_cli
from tests.helpers.dockerfile import DOCKERFILE, IMAGE_POLICY, Instruction, parse_dockerfile

DOCKERIGNORE = ROOT / ".dockerignore"


# -- the wheel -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "--wheel-dir", str(out)]
    if importlib.util.find_spec("hatchling") is not None:
        cmd.append("--no-build-isolation")
    cmd.append(str(ROOT))
    result = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(checkout=False),
        cwd=out,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, f"pip wheel failed:\n{result.stdout}\n{result.stderr}"
    (built,) = out.glob("quota_proxy-*.whl")
    return built


def _dist_info(names: list[str]) -> str:
    (dist_info,) = {n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")}
    return dist_info


def test_every_lua_script_in_the_checkout_is_one_the_code_loads() -> None:
    assert (
        {p.stem for p in (ROOT / "lua").glob("*.lua")}
        == set(NAMES)
        == {"acquire", "feedback", "inflight", "leave", "peek", "presence", "probe", "refund", "release", "renew"}
    )


def test_wheel_carries_the_lua_scripts_and_the_console_script(wheel: Path) -> None:
    assert wheel.name == f"quota_proxy-{proxy.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        for name in NAMES:
            packaged = zf.read(f"proxy/lua/{name}.lua")
            assert packaged == (ROOT / "lua" / f"{name}.lua").read_bytes(), name
        for page in ("index.html", "ui.js", "ui.css"):  # the admin port's live page
            assert (
                zf.read(f"proxy/ops/admin_page/{page}") == (ROOT / "proxy" / "ops" / "admin_page" / page).read_bytes()
            ), page
        dist_info = _dist_info(names)
        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(f"{dist_info}/entry_points.txt").decode())
        metadata = zf.read(f"{dist_info}/METADATA").decode()

    assert entry_points["console_scripts"]["quota-proxy"] == "proxy.cli:main"
    assert "Name: quota-proxy\n" in metadata
    assert f"Version: {proxy.__version__}\n" in metadata
    for module in (
        "proxy/__init__.py",
        "proxy/__main__.py",
        "proxy/cli.py",
        "proxy/limiter/scripts.py",
        "proxy/devtools/mockvendor.py",
        "proxy/devtools/mockvendor_cli.py",
        "proxy/devtools/demo.py",
        "proxy/devtools/demo_cli.py",
        "proxy/devtools/demo_fleet.py",
        "proxy/devtools/demo_report.py",
    ):
        assert module in names
    assert not [n for n in names if n.startswith(("lua/", "tests/", "config/")) or "__pycache__" in n], names


@dataclass(frozen=True)
class Venv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.root / "bin" / name


def _fresh_venv(path: Path) -> Venv:
    """A new venv that sees the running interpreter's installed dependencies but not the checkout."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(path)],
        check=True,
        timeout=120,
        capture_output=True,
        stdin=subprocess.DEVNULL,
    )
    venv = Venv(path)
    if sys.prefix != sys.base_prefix:
        # The tests run inside a virtualenv (CI's .venv): its packages are not the base
        # interpreter's "system" ones. List its site directories as plain path lines, so none of
        # its .pth files (an editable install of this checkout among them) is processed.
        outer = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
        site = subprocess.run(
            [str(venv.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
        (Path(site) / "zz_outer_env.pth").write_text("".join(f"{p}\n" for p in outer))
    return venv


SHOW_INSTALLED = """
import json, pathlib, sys
import proxy
import proxy.limiter.scripts as scripts
print(json.dumps({
    "prefix": sys.prefix,
    "proxy": proxy.__file__,
    "scripts_module": scripts.__file__,
    "checkout_fallback": str(pathlib.Path(scripts.__file__).resolve().parents[2] / "lua"),
    "scripts": {name: scripts.script(name) for name in scripts.NAMES},
}))
"""


def test_installed_wheel_runs_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    venv = _fresh_venv(tmp_path / "venv")
    install = subprocess.run(
        [str(venv.python), "-m", "pip", "install", "--no-deps", "--no-index", "--no-cache-dir", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(checkout=False),
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = clean_env(checkout=False)

    shown = subprocess.run(
        [str(venv.python), "-c", SHOW_INSTALLED],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=elsewhere,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    venv_root = venv.root.resolve()
    assert Path(info["prefix"]).resolve() == venv_root
    for module in (info["proxy"], info["scripts_module"]):
        assert Path(module).resolve().is_relative_to(venv_root), module
        assert not Path(module).resolve().is_relative_to(ROOT), module
    # No checkout lua/ beside the installed package: the scripts came from the wheel's proxy/lua.
    assert not Path(info["checkout_fallback"]).exists()
    for name in NAMES:
        assert info["scripts"][name] == (ROOT / "lua" / f"{name}.lua").read_text(encoding="utf-8"), name

    console = venv.bin("quota-proxy")
    assert console.is_file()
    checked = subprocess.run(
        [str(console), "check", "-c", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=elsewhere,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.splitlines()[0] == f"OK {EXAMPLE}: 1 vendor(s)"

    version = subprocess.run(
        [str(console), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=elsewhere,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    # The release, then the Python and each runtime library the wheel's metadata names, with versions.
    lines = version.stdout.splitlines()
    assert lines[0] == f"quota-proxy {proxy.__version__}", version.stdout
    libraries = dict(line.split(" ", 1) for line in lines[2:])
    for name in ("aiohttp", "httptools", "redis", "hiredis", "prometheus-client", "pyyaml", "cryptography", "uvloop"):
        assert re.fullmatch(r"\d+(\.\d+)+\S*", libraries.get(name, "")), (name, version.stdout)

    for tool in ("mock-vendor", "demo"):  # the developer tools ship in the wheel too
        helped = subprocess.run(
            [str(console), tool, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=elsewhere,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        assert helped.returncode == 0, helped.stderr
        assert helped.stdout.startswith(f"usage: quota-proxy {tool} "), helped.stdout


# -- the Dockerfile --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def only(instructions: list[Instruction], keyword: str) -> Instruction:
    (found,) = [i for i in instructions if i.keyword == keyword]
    return found


def _healthcheck_argv(dockerfile: list[Instruction]) -> list[str]:
    health = only(dockerfile, "HEALTHCHECK")
    options, sep, command = health.args.partition("CMD ")
    assert sep, health
    for option in shlex.split(options):
        assert re.fullmatch(r"--(interval|timeout|start-period|start-interval|retries)=\w+", option), option
    return Instruction("CMD", command, health.line).exec_form()


def _glob_regex(pattern: str) -> str:
    """A .dockerignore pattern as a regex: ``*`` and ``?`` stay within a path segment, ``**`` does not."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out.append(pattern[i : end + 1])
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


def _dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    excluded = False
    for raw in DOCKERIGNORE.read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        regex = _glob_regex(pattern.lstrip("!").strip("/"))
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def test_dockerfile_builds_a_non_root_image_that_drains_on_sigterm(dockerfile: list[Instruction]) -> None:
    keywords = [i.keyword for i in dockerfile]
    (base,) = [i.args for i in dockerfile if i.keyword == "FROM"]
    assert base == "python:3.11-slim"

    users = [i for i in dockerfile if i.keyword == "USER"]
    assert users, "the image must not run as root"
    user = users[-1].args.split(":", 1)[0]
    assert user not in ("root", "0")
    runs = [i for i in dockerfile if i.keyword == "RUN"]
    assert any(re.search(rf"useradd\b.*\b{re.escape(user)}\s*$", r.args) for r in runs), "the user is created"
    assert keywords.index("CMD") > dockerfile.index(users[-1])
    assert all(r.line < users[-1].line for r in runs), "nothing runs as root after USER"

    assert any(re.search(r"\bpip install --no-deps \.(\s|$)", r.args) for r in runs), "a real, non-editable install"
    assert only(dockerfile, "STOPSIGNAL").args == "SIGTERM"
    assert set(only(dockerfile, "EXPOSE").args.split()) == {"8080", "9090"}
    assert only(dockerfile, "CMD").exec_form() == ["quota-proxy", "run", "--workers", "auto", "-c", IMAGE_POLICY]

    argv = _healthcheck_argv(dockerfile)
    assert argv[:2] == ["python", "-c"], "no curl in the slim image"
    assert "/healthz" in argv[2]


def test_dockerfile_copies_only_what_exists_and_the_context_keeps(dockerfile: list[Instruction]) -> None:
    copies = [i for i in dockerfile if i.keyword in ("COPY", "ADD")]
    assert copies
    sources: list[str] = []
    for copy in copies:
        assert copy.keyword == "COPY", "ADD fetches and unpacks: COPY is what is meant"
        *srcs, _dest = shlex.split(copy.args)
        assert srcs, copy
        sources += srcs
    for source in sources:
        assert not source.startswith("--"), f"{source}: no --from stages expected"
        path = ROOT / source
        assert path.exists(), f"the Dockerfile copies {source}, which is not in the repository"
        assert not _dockerignore_excludes(source.rstrip("/")), f".dockerignore drops {source}"
        for inner in path.rglob("*") if path.is_dir() else []:
            rel = inner.relative_to(ROOT).as_posix()
            if inner.is_file() and "__pycache__" not in rel and not rel.endswith(".pyc"):
                assert not _dockerignore_excludes(rel), f".dockerignore drops {rel}"
    for needed in ("pyproject.toml", "uv.lock", "scripts/uv-requirements.txt", "README.md", "proxy", "lua", "config"):
        assert needed in {s.rstrip("/") for s in sources}, needed
    for kept_out in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/conftest.py",
        "proxy/__pycache__/cli.cpython-311.pyc",
        ".mypy_cache/x",
        "bench/run.py",
    ):
        assert _dockerignore_excludes(kept_out), kept_out


def _uv_pin(text: str) -> str:
    (version,) = re.findall(r"^uv==(\S+)", text, flags=re.MULTILINE)
    return version


def test_dockerfile_installs_the_locked_libraries_by_hash(dockerfile: list[Instruction], tmp_path: Path) -> None:
    """The image gets the versions the tests ran on: the Dockerfile's own `uv export` of uv.lock,
    run here as written on the files it copies, pins every runtime library (and only those)
    with hashes, and pip installs exactly that list before the package without resolving."""
    (install,) = [r for r in dockerfile if r.keyword == "RUN" and "uv export" in r.args]
    steps = [step.strip() for step in install.args.split("&&")]
    assert steps[0] == "pip install -r scripts/uv-requirements.txt", steps
    (export,) = [s for s in steps if s.startswith("uv export")]
    argv = shlex.split(export)
    assert "--frozen" in argv and "--no-dev" in argv and "--no-emit-project" in argv, argv
    assert not any(a.startswith("--extra") or a == "--all-extras" for a in argv), argv
    requirements = argv[argv.index("--output-file") + 1]
    assert f"pip install --require-hashes --no-deps -r {requirements}" in steps
    assert steps.index(f"pip install --require-hashes --no-deps -r {requirements}") < steps.index(
        "pip install --no-deps ."
    )

    # uv in the test environment is the one the image and scripts/test install.
    pinned = _uv_pin((ROOT / "scripts/uv-requirements.txt").read_text())
    assert "--hash=sha256:" in (ROOT / "scripts/uv-requirements.txt").read_text()
    uv = Path(sys.executable).parent / "uv"
    version = subprocess.run([str(uv), "--version"], capture_output=True, text=True, timeout=30, check=True)
    assert version.stdout.split()[:2] == ["uv", pinned]

    context = tmp_path / "src"
    for copy in (c for c in dockerfile if c.keyword == "COPY" and not shlex.split(c.args)[-1].startswith("/")):
        *sources, dest = shlex.split(copy.args)
        for source in sources:
            target = context / dest / Path(source).name if dest.endswith("/") else context / dest
            target.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / source).is_file():
                target.write_bytes((ROOT / source).read_bytes())
    assert (context / "uv.lock").is_file() and (context / "pyproject.toml").is_file()
    exported = subprocess.run(
        [str(uv), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=context,
        env={**clean_env(checkout=False), "UV_OFFLINE": "1", "UV_PYTHON_DOWNLOADS": "never"},
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert exported.returncode == 0, exported.stderr
    text = (context / requirements).read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", text, flags=re.MULTILINE))
    for name in ("aiohttp", "httptools", "redis", "hiredis", "prometheus-client", "pyyaml", "uvloop", "cryptography"):
        assert name in pins, (name, text)
    for test_only in ("pytest", "mypy", "ruff", "stripe", "mkdocs", "uv", "quota-proxy"):
        assert test_only not in pins, test_only
    # Every requirement carries at least one hash (pip --require-hashes refuses one without).
    entries = re.split(
        r"\n(?=[A-Za-z0-9])", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    )
    for entry in (e for e in entries if e.strip()):
        assert "--hash=sha256:" in entry, entry


def _image_policy(dockerfile: list[Instruction]) -> tuple[str, str]:
    """The text of /etc/quota-proxy/policy.yaml as the RUN line makes it, and its source file."""
    copies = {
        shlex.split(c.args)[-1].rstrip("/"): shlex.split(c.args)[0].rstrip("/")
        for c in dockerfile
        if c.keyword == "COPY"
    }
    (make,) = [r for r in dockerfile if r.keyword == "RUN" and f"> {IMAGE_POLICY}" in r.args]
    sed = re.search(rf"sed((?:\s+-e\s+'[^']*')+)\s+(\S+)\s+>\s+{re.escape(IMAGE_POLICY)}", make.args)
    assert sed, make.args
    image_source = sed.group(2)
    directory, _, filename = image_source.rpartition("/")
    assert directory in copies, f"{image_source} is not copied in"
    repo_source = f"{copies[directory]}/{filename}"
    text = (ROOT / repo_source).read_text()
    expressions = re.findall(r"-e\s+'([^']*)'", sed.group(1))
    for expression in expressions:
        match = re.fullmatch(r"s/((?:[^/\\]|\\.)*)/((?:[^/\\]|\\.)*)/", expression)
        assert match, expression
        text, count = re.subn(match[1], match[2], text, count=1, flags=re.MULTILINE)
        assert count == 1, f"{expression} changes nothing in {repo_source}"
    # The real sed agrees with that reading of its expressions.
    real = subprocess.run(
        ["sed", *(a for e in expressions for a in ("-e", e)), str(ROOT / repo_source)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert real.stdout == text
    assert f"quota-proxy check -c {IMAGE_POLICY}" in make.args, "the build validates the policy"
    return text, repo_source


def test_image_policy_is_the_example_listening_on_every_interface(
    dockerfile: list[Instruction], tmp_path: Path
) -> None:
    text, source = _image_policy(dockerfile)
    assert source == "config/example.yaml"
    policy = parse_policy(text, IMAGE_POLICY, base_dir=ROOT)
    assert (policy.listen.host, policy.listen.port) == ("0.0.0.0", 8080)
    assert (policy.admin_listen.host, policy.admin_listen.port) == ("0.0.0.0", 9090)
    assert {str(policy.listen.port), str(policy.admin_listen.port)} == set(only(dockerfile, "EXPOSE").args.split())
    (default_url,) = re.findall(r"http://127\.0\.0\.1:(\d+)/healthz", _healthcheck_argv(dockerfile)[2])
    assert int(default_url) == policy.admin_listen.port

    # What `quota-proxy check` in the build will say about it.
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    checked = run_cli("check", "-c", str(path))
    assert checked.returncode == 0, checked.stderr


async def test_healthcheck_command_probes_the_admin_listener(dockerfile, vendor, start_proxy) -> None:
    argv = [sys.executable, *_healthcheck_argv(dockerfile)[1:]]
    server = await start_proxy(vendor_policy(vendor.url))

    def probe(url: str) -> int:
        env = clean_env({"QUOTA_PROXY_HEALTHCHECK_URL": url}, checkout=False)
        return subprocess.run(
            argv, env=env, capture_output=True, timeout=30, stdin=subprocess.DEVNULL, check=False
        ).returncode

    assert await asyncio.to_thread(probe, f"{server.admin_url}/healthz") == 0
    assert await asyncio.to_thread(probe, f"http://127.0.0.1:{free_port()}/healthz") == 1


# -- the lock ------------------------------------------------------------------------------------


def _lock_checkout(tmp_path: Path) -> Path:
    """What scripts/check-lock reads, copied: pyproject.toml, uv.lock and the version's source."""
    for name in ("pyproject.toml", "uv.lock", "README.md", "proxy/__init__.py", "scripts/check-lock"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    return tmp_path


def _check_lock(checkout: Path) -> subprocess.CompletedProcess[str]:
    uv = Path(sys.executable).parent / "uv"
    return subprocess.run(
        ["bash", "scripts/check-lock", str(uv)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=checkout,
        # Not offline: a stale lock is found by resolving again, which may ask the index.
        env={**clean_env(checkout=False), "UV_PYTHON_DOWNLOADS": "never"},
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_the_lock_is_current_and_a_stale_one_stops_the_test_command_with_how_to_refresh_it(tmp_path: Path) -> None:
    checkout = _lock_checkout(tmp_path)
    current = _check_lock(checkout)
    assert current.returncode == 0, current.stderr

    pyproject = checkout / "pyproject.toml"
    text = pyproject.read_text()
    assert '"pyyaml>=6.0",' in text
    pyproject.write_text(text.replace('"pyyaml>=6.0",', '"pyyaml>=6.0.2",', 1))  # a floor moved, the lock not
    stale = _check_lock(checkout)
    assert stale.returncode == 1, stale.stderr
    assert "needs to be updated" in stale.stderr, stale.stderr  # stale, not merely offline
    assert "uv.lock is out of date with pyproject.toml: refresh it with" in stale.stderr
    assert "uv lock" in stale.stderr.splitlines()[-1]
    assert "scripts/check-lock" in (ROOT / "scripts/test").read_text()
