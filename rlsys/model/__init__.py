"""What rlsys knows of a model directory before anything is built: its config.json and the
architecture transformers makes of it (`architecture`), the policy the trainers build on the meta
device (`built`), its shapes for the memory plan (`shape`), and the checks trainer rank 0 makes
before loading it (`checks`). The run, `rlsys plan`, `rlsys doctor`, `rlsys engines` and the
trainer ranks all read the model through these modules."""
