"""The policy: YAML in, a frozen and validated model out (``load_policy``), and its summary."""

from proxy.policy.durations import format_duration, parse_duration
from proxy.policy.errors import ConfigError, ConfigErrors
from proxy.policy.loader import load_policy, mask_password, parse_address, parse_policy, parse_store_url
from proxy.policy.model import (
    ACTIONS,
    CONNECT_MODES,
    FAILURE_MODES,
    Action,
    Address,
    Breaker,
    ConnectMode,
    FailureMode,
    Feedback,
    Limit,
    OnLimit,
    Policy,
    StoreSettings,
    TenantLimits,
    TenantSettings,
    Timeouts,
    TlsSettings,
    Vendor,
)
from proxy.policy.summary import summarize

__all__ = [
    "ACTIONS",
    "CONNECT_MODES",
    "FAILURE_MODES",
    "Action",
    "Address",
    "Breaker",
    "ConfigError",
    "ConfigErrors",
    "ConnectMode",
    "FailureMode",
    "Feedback",
    "Limit",
    "OnLimit",
    "Policy",
    "StoreSettings",
    "TenantLimits",
    "TenantSettings",
    "Timeouts",
    "TlsSettings",
    "Vendor",
    "format_duration",
    "load_policy",
    "mask_password",
    "parse_address",
    "parse_duration",
    "parse_policy",
    "parse_store_url",
    "summarize",
]
