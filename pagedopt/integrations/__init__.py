"""Integrations of pagedopt with training frameworks.

Each submodule imports its framework only when it is imported itself; ``import pagedopt`` imports
none of them. ``pagedopt.integrations.transformers``: ``optim=`` names for the Hugging Face Trainer;
``pagedopt.integrations.callbacks``: ``MemoryReportCallback``, memory figures in the Trainer's log history.
"""
