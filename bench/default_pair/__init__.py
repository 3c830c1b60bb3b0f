"""Measurements of specdec's default pair (specdec/assets/default_pair/): speed.py (`python -m
bench.default_pair.speed`) times the shipped pair in specdec's own runtime.

The trainers moved into the package: `python -m specdec.train small` (the default pair) and `python -m
specdec.train feature` (the SmolLM2 feature draft), docs/train.md. The records of the runs that made the shipped
drafts stay here: results.json (the pair), feature_draft_results.json (the SmolLM2 draft) and
candidate_draft_1x256.json (a candidate draft, docs/default_pair.md).
"""
