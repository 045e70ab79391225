"""Per-layer KV heads under a cache budget (`--kv-budget`): the budget as given (`kvbudget`,
torch-free), the damage of each layer's candidates measured on calibration text (`damage`),
the exact allocation (`allocate`, torch-free) and the choice that ties them together for a
conversion or `gqakit inspect --kv-budget` (`choose`). Nothing is imported here, so that the
settings read the budget without torch."""
