#pragma once
/// \file
/// Needle (pass-key) retrieval prompts: a haystack of real text with the sentence
/// "The pass key is 48213. Remember it." inserted at a depth, then the question "What is the pass
/// key?" and the start of the answer "The pass key is", so that greedy decoding continues with
/// the digits. A trial passes when the first run of digits the model writes is the key.
///
/// Prompt text (haystack cut at a sentence end so the whole prompt fits the context length):
///
///     There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. I will
///     quiz you about the pass key.
///
///     <haystack ... The pass key is 48213. Remember it. ... haystack>
///
///     What is the pass key?
///
/// - `chatml` (instruct models such as SmolLM2-Instruct): that text is the user message of
///   `kvq::llama::chatml_prompt` (SmolLM2's template, default system message), followed by the
///   assistant's answer prefix "The pass key is".
/// - `plain` (base models): the text, then " The pass key is"; BOS first when the vocabulary
///   asks for it.

#include <cstdint>
#include <kvq/status.hpp>
#include <llama/tokenizer.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace kvq::eval {

/// How the needle prompt is wrapped for the model.
enum class prompt_template : uint8_t {
  plain,   ///< raw text (base models)
  chatml,  ///< SmolLM2's ChatML chat template (instruct models)
};

constexpr const char* template_name(prompt_template t) { return t == prompt_template::chatml ? "chatml" : "plain"; }

/// The sentence inserted into the haystack: "The pass key is <key>. Remember it."
std::string needle_sentence(std::string_view key);

/// A key of `digits` decimal digits (first digit non-zero) drawn deterministically from `seed`.
std::string make_key(uint64_t seed, int digits = 5);

/// One needle trial: where the key goes and how long the prompt is.
struct needle_trial {
  int64_t context = 0;  ///< largest prompt length in tokens
  double depth = 0.5;   ///< fraction (0..1) of the haystack text that comes before the needle
  int rep = 0;          ///< repetition index (a different key per repetition)
  std::string key;      ///< the digits to retrieve
};

/// A built prompt.
struct needle_prompt {
  std::vector<kvq::llama::token_id> tokens;  ///< the whole prompt, answer prefix included
  int64_t haystack_chars = 0;                ///< characters of haystack text used
  int64_t needle_char = 0;                   ///< offset of the needle in the haystack text used
  double depth = 0;                          ///< needle_char / haystack_chars (actual depth)
};

/// Offsets just past each sentence end of `text` (after ". ", "! ", "? ", a closing quote after
/// one of these, or a paragraph break), in increasing order; always ends with text.size().
std::vector<size_t> sentence_ends(std::string_view text);

/// The prompt text (before tokenization, without the chat wrapper) for a haystack cut of `body`
/// with the needle already inserted.
std::string needle_question_text(std::string_view body);

/// Builds the prompt of `trial` from `haystack` (real text, long enough for the context): the
/// longest whole-sentence prefix of the haystack such that the tokenized prompt has at most
/// `trial.context` tokens, the needle inserted at the sentence boundary nearest to
/// `trial.depth`. Errors (invalid_argument): a context too small for the question alone, a
/// haystack too short to fill 90 % of the context, a haystack with no sentence that fits, a
/// depth outside [0, 1], an empty key.
kvq::result<needle_prompt> build_needle_prompt(const kvq::llama::tokenizer& tok, std::string_view haystack,
                                               const needle_trial& trial, prompt_template tmpl);

/// The digits of the first run of digits in `text` ("" when there is none).
std::string first_digit_run(std::string_view text);

/// True when the first run of digits in the generated `text` is exactly `key`.
bool needle_passed(std::string_view text, std::string_view key);

}  // namespace kvq::eval
