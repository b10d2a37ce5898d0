"""The report's sections, one module each, in the order the report shows them: env, variants (each variant, the
expert load, the comparison of several runs), parity, library, checkpoint (the `moebench checkpoint` audits), bench,
gpu. Each reads results files only and returns render blocks."""
