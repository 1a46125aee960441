"""megastart's Hydra configs, shipped as package data (``megastart.configs``)."""
