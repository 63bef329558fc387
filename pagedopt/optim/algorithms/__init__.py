"""The algorithms: one module each with its spec (spec.py: states, hyperparameters and checks,
kernel) and its table of public variants (variants.py). pagedopt.optim imports the classes from
them; this package's own import brings in nothing, so that the pipeline's modules can read
spec.py without loading the classes."""
