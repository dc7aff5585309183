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
    # Images by http(s) URL (vision-language models): off unless --allow-image-urls; data: URLs always.
    allow_image_urls: bool = False
    image_fetch_timeout: float = 10.0  # --image-fetch-timeout: seconds for one image's download
    max_image_bytes: int = 20 << 20  # --max-image-bytes: a larger download is refused
