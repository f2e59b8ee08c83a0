"""The on-disk format of a checkpoint directory: step names and markers (``layout``,
``markers``), integrity (``integrity``), which steps are kept (``retention``), and what a
save recorded (``metrics``).
"""
