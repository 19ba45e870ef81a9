"""What a run shows: the run folder (runfolder: where it is, and when a fit's files land in it),
summary.json (summary), stragglers, provenance, the live progress line (progress), TensorBoard
scalars (tb) and `elastic-train report` (report).

May import: config, data. Imports no Ray: the RunLog actor that writes the run folder and the
metrics sent to Ray live in cluster/.
"""
