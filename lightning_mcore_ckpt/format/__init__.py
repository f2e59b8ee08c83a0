"""The on-disk format of a checkpoint directory: step names and markers (``layout``,
``markers``), integrity (``integrity``), which steps are kept (``retention``), what a
save recorded (``metrics``) and a step's saved loop counters between epochs (``loops``).
"""
