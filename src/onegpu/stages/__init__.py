"""Stage entry points that dvc.yaml calls: thin wiring of the modules, no logic of their own."""
