"""OasisKV: an LLM serving engine that decodes long contexts beyond GPU memory."""
from oasiskv.entrypoints.llm import LLM
from oasiskv.sampling_params import SamplingParams, StructuredOutput

__all__ = ["LLM", "SamplingParams", "StructuredOutput"]
__version__ = "0.1.0"
