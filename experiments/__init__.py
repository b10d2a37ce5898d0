"""The presets: experiments/<variant>/<preset>.json, installed as the package moebench.experiments
(see setup.py) and read with importlib.resources, from a checkout and from a wheel alike."""
