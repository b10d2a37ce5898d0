"""moebench: reproduce and verify the Mixture-of-Experts experiments of "chapter 6"."""

__version__ = "0.1.0"
