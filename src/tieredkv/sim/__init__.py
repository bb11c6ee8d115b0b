"""Trace-driven simulation: turn streams (read from a trace file or a dataset, or
generated), eviction-only replays, and a discrete-event serving simulator that runs the
library's policy objects under a virtual clock.

- :mod:`.trace`, :mod:`.synthetic`, :mod:`.workloads`: workloads;
- :mod:`.costmodel`: model and GPU presets, step times, cost efficiency;
- :mod:`.systems`: serving systems (vLLM, CachedAttention, FlashGen, Bidaw, ideal);
- :mod:`.engine`: the serving simulator, an event loop over :mod:`.host` (residency and
  eviction), :mod:`.ssd` (the device and its write buffer, with the :mod:`.writepath`
  strategy) and :mod:`.gpu` (batching, step times); :mod:`.config` its settings and
  results; :mod:`.predict` predictive reads; :mod:`.replay`: eviction-only replay;
- :mod:`.analysis`: reuse distances and the paper's other workload analyses;
- :mod:`.sweep`, :mod:`.report` (with :mod:`.render` and :mod:`.plots`),
  :mod:`.saturation`, :mod:`.calibration`: many runs, the throughput metric, ``tieredkv
  reproduce``, the SLO and the paper's anchors.

The policies simulated are the very objects the live cache uses
(:mod:`tieredkv.policies`); the simulator only feeds them time and metadata.
"""
