"""The commands installed with the package (`[project.scripts]` in pyproject.toml): `vit-train`,
`vit-rollout`, `vit-sample`, `vit-bench`, `vit-export` and `vit-resize-folder`. `scripts/<name>.py`
runs the same code from a checkout.

Each module's `main(argv)` returns what it made (for tests and notebooks); its `cli()` is the
entry point, returning nothing, since a console script's return value becomes its exit status.
"""
