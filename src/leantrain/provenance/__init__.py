"""Provenance: what a run or checkpoint was built from (lineage.json) and the run registry."""
