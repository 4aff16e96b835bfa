"""OasisKV: an LLM serving engine that decodes long contexts beyond GPU memory."""
import oasiskv.eval.baseline_drafters  # noqa: F401  (registers the oracle and ondemand drafters)
from oasiskv.entrypoints.llm import LLM
from oasiskv.sampling_params import SamplingParams, StructuredOutput

__all__ = ["LLM", "SamplingParams", "StructuredOutput"]
__version__ = "0.1.0"
