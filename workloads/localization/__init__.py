"""The localization cases, shared by the localization benchmark (``python -m benchmarks.localization``)
and its smoke tests: model families (:mod:`.models`, :mod:`.fused_models`), fault injectors
(:mod:`.faults`), case planning (:mod:`.cases`), and one case captured, compared and scored
(:mod:`.runner`).
"""
