"""Text over the token-id engine: encoding, decoding and stop strings, in one place.

The engine (flexgen_helm.engine) takes and returns token ids. Every frontend that deals in
text (the CLI's `generate`, the HELM plugin, evaluation, Python users) goes through this
package:

  * `TokenText`: the bytes and text of token ids for one tokenizer (thread-safe);
  * `StopStrings`: the one stop-string implementation. The engine calls it after every
    token (it is an executor.sampling.StopCondition) so that generation ends early, and
    the frontend cuts the completion's text and tokens with it;
  * `TextEngine`: text prompts in, text completions (and the run's RunStats) out;
  * `check_text_request`: sampling settings, empty stop strings, empty prompts and prompts past the context,
    refused before the model loads.

    from flexgen_helm.text import TextEngine
    engine = TextEngine.load("smollm2-135m")
    run = engine.generate(["Once upon a time"], SamplingParams(max_new_tokens=20), stop_strings=["\\n"])
    print(run.results[0].completions[0].text, run.stats.total_s)
"""

from flexgen_helm.text.engine import TextCompletion, TextEngine, TextResult, TextRun, check_text_request
from flexgen_helm.text.stopping import StopCut, StopStrings
from flexgen_helm.text.token_text import TokenText, token_text_for

__all__ = ["StopCut", "StopStrings", "TextCompletion", "TextEngine", "TextResult", "TextRun", "TokenText",
           "check_text_request", "token_text_for"]
