"""`tsenor sweep`: a grid of prune + eval runs from a sweep file, run locally or as a SLURM job array.

- `spec`: the sweep file → a frozen `SweepSpec` whose `runs()` are the grid's points, validated
  before anything is written or submitted;
- `job`: one run (prune with --resume, then eval, in subprocesses) and its SLURM task;
- `executors`: the plan (what each run directory holds), the local and the SLURM executors;
- `status`: each run's state from its status files and SLURM's queue.
"""
