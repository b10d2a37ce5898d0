"""The statuses an env-check item has, and a variant's capability line with it: ok, warn, fail, skip.

Here, below every package, so that the variants (which say what they can do here) and env-check (which asks
them) name them alike without the variants importing env-check."""

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)
