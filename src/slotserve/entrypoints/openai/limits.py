"""What one request to the server may ask for (torch-free: the CLI reads the defaults for its help)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; each is a `slotserve serve` flag."""

    max_body_bytes: int = 8 << 20  # --max-request-bytes: larger bodies get 413 before they are read
    max_n: int = 128  # --max-n: sequences one request may start (n times its prompts)
    max_stop: int = 16  # --max-stop: stop strings, and stop token ids, per request
    max_logit_bias: int = 1024  # --max-logit-bias: entries in logit_bias
