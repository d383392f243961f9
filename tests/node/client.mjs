// One HTTP request the way a Node worker makes it through quota-proxy, for the tests:
// undici's EnvHttpProxyAgent reads HTTP_PROXY / HTTPS_PROXY / NO_PROXY (Node's built-in
// fetch and https ignore them) and Node trusts the proxy's CA through NODE_EXTRA_CA_CERTS.
// proxyTunnel: false sends http:// requests to the proxy in absolute form, as every other
// client does (undici would otherwise CONNECT even for plain http).
//
//   node client.mjs METHOD URL [HEADERS_JSON] [BODY_FILE]
//
// Prints one JSON line: {"status", "headers", "body" (base64)}, or {"error", "code", "cause"}
// with exit status 3 when the request failed below HTTP (TLS, connection).
import { readFileSync } from "node:fs";
import { EnvHttpProxyAgent, fetch } from "undici";

const [method, url, headersJson = "{}", bodyFile] = process.argv.slice(2);
const dispatcher = new EnvHttpProxyAgent({ proxyTunnel: false });
try {
  const res = await fetch(url, {
    method,
    headers: JSON.parse(headersJson),
    body: bodyFile ? readFileSync(bodyFile) : undefined,
    dispatcher,
  });
  const body = Buffer.from(await res.arrayBuffer());
  const headers = Object.fromEntries(res.headers.entries());
  console.log(JSON.stringify({ status: res.status, headers, body: body.toString("base64") }));
} catch (err) {
  const cause = err.cause ?? err;
  console.log(JSON.stringify({ error: String(err.message), code: cause.code ?? null, cause: String(cause.message ?? cause) }));
  process.exitCode = 3;
} finally {
  await dispatcher.close();
}
