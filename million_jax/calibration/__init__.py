"""Calibration on arrays: collect keys / values from a dense cache and fit a model's codebooks
(``fit``); fine-tune the centroids on the attention-output error (``finetune``)."""
