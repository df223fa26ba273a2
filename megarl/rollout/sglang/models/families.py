"""``EntryClass``: SGLang's class of each ``model_specs.FAMILIES`` architecture (its module is
named after the HF model type), read by SGLang's ``import_model_classes``."""

import importlib

from model_specs import FAMILIES

EntryClass = [getattr(importlib.import_module(f"sglang.srt.models.{family.hf_model_type}"), family.hf_architecture)
              for family in FAMILIES.values()]
