"""Keep credentials out of everything we send to a tracking server.

Configs, paths and URIs can carry secrets (a database password in a tracking URI, a
token in a URL query, an ``HF_TOKEN`` pasted into a field). Every param, tag, config
artifact and error message goes through ``scrub`` before it leaves the process.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

MASK = "***"

# Key names whose values are secrets whatever they look like. "token" alone is not
# enough: ``mask_token`` and ``max_tokens`` are ordinary config keys.
_SECRET_KEY_WORDS = ("password", "passwd", "secret", "api_key", "apikey", "credential", "private_key")
_SECRET_KEY_NAMES = {"token", "pwd", "auth", "authorization", "key_secret"}
_SECRET_KEY_SUFFIXES = ("access_token", "auth_token", "api_token", "hf_token", "bearer_token",
                        "refresh_token", "id_token", "session_token", "secret_token")

_VALUE_PATTERNS = [
    # user:password@ in any URI (postgresql://, https://, s3://...): keep the user, hide the password
    (re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^/\s:@]+):[^/\s@]+@"), r"\g<head>:" + MASK + "@"),
    # credentials in a query string (presigned URLs, ?token=...)
    (re.compile(r"(?i)(?P<head>[?&](?:token|access_token|api_key|apikey|key|sig|signature|password|"
                r"x-amz-signature|x-amz-credential|x-amz-security-token)=)[^&\s#]+"), r"\g<head>" + MASK),
    (re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=\-]{8,}"), "Bearer " + MASK),
    # well-known token shapes
    (re.compile(r"\bhf_[A-Za-z0-9]{16,}"), MASK),
    (re.compile(r"\bsk-[A-Za-z0-9_\-]{16,}"), MASK),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{16,}"), MASK),
    (re.compile(r"\bgithub_pat_[A-Za-z0-9_]{16,}"), MASK),
    (re.compile(r"\bxox[abpr]-[A-Za-z0-9\-]{10,}"), MASK),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), MASK),
    (re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"), MASK),  # JWT
]


def _norm(key: str) -> str:
    return str(key).rsplit(".", 1)[-1].lower().replace("-", "_")


def is_secret_key(key: str) -> bool:
    """True for a config/env key whose value must never be logged (``*_api_key``, ``password``...)."""
    k = _norm(key)
    return (
        k in _SECRET_KEY_NAMES
        or any(w in k for w in _SECRET_KEY_WORDS)
        or k.endswith(_SECRET_KEY_SUFFIXES)
    )


# The shell's working-directory variables are paths, not passwords.
_NOT_SECRET_ENV = {"PWD", "OLDPWD"}


def _is_secret_env_name(name: str) -> bool:
    if name.upper() in _NOT_SECRET_ENV:
        return False
    parts = name.upper().split("_")
    return (
        is_secret_key(name)
        or "TOKEN" in parts
        or "PASSWORD" in parts
        or "SECRET" in parts
        or ("API" in parts and "KEY" in parts)
    )


def secret_env_values() -> list[str]:
    """Values of secret-named environment variables (HF_TOKEN, WANDB_API_KEY, ...), longest first."""
    values = {v for k, v in os.environ.items() if _is_secret_env_name(k) and len(v) >= 8}
    return sorted(values, key=len, reverse=True)


def scrub_text(text: str) -> str:
    """Mask credentials inside one string: URI passwords, query tokens, token shapes, env secrets."""
    for value in secret_env_values():
        text = text.replace(value, MASK)
    for pattern, repl in _VALUE_PATTERNS:
        text = pattern.sub(repl, text)
    return text


def scrub(obj, key: str = ""):
    """Return ``obj`` (nested dicts/lists/scalars) with secret-named keys and secret-looking values masked."""
    if key and is_secret_key(key) and obj not in (None, "", False):
        return MASK
    if isinstance(obj, Mapping):
        return {k: scrub(v, str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v) for v in obj]
    if isinstance(obj, str):
        return scrub_text(obj)
    return obj
