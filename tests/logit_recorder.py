"""Keeps every step's logits of an `LLM` (one row per sampled sequence) while a test runs."""


def record_logits(llm):
    """(the list the logits go into, a function that puts compute_logits back)."""
    model, seen = llm.engine.runner.model, []
    original = model.compute_logits

    def recording(hidden):
        logits = original(hidden)
        seen.append(logits.clone())
        return logits
    model.compute_logits = recording
    return seen, lambda: setattr(model, "compute_logits", original)
