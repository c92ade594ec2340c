"""Training recipes for the Hydra app: LightningModules and LightningDataModules."""
