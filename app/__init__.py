"""The Hydra app's own parts (``train.py``): its console, and the replica groups it starts on one
machine for fault tolerance. The model recipes are in ``recipes/``."""
