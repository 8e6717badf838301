"""The studies behind the reports in this folder, run from the repository root as
`python -m benchmarks.<study>` (budget, ablate, compare, finetune_study, rollout_eval, data_caps)."""
