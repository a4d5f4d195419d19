"""Simulation at scale (issue #19): the real scheduler over a cost model instead of a model.

`Simulator` (simulator.py) runs this project's Scheduler, radix cache and trace in-process, with a
model worker that computes nothing but knows how long each step would take on a given deployment
(cost_model.py over hardware.py and model_specs.py), on a simulated clock.
"""
