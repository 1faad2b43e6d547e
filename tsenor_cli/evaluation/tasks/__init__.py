"""Offline lm-eval task configs for the paper's eight zero-shot tasks (Section 5.2).

The YAML files here mirror lm-evaluation-harness's own task definitions; `converters` turns the
files of the offline data folder (--data-dir) into the document dicts those definitions read.
`docs/guide/zeroshot.md` lists every difference from the hub versions.
"""
