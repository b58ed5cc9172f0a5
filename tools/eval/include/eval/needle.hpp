#pragma once
/// \file
/// Needle retrieval prompts of two kinds (`needle_kind`). A trial passes when the first run of
/// digits the model writes after the answer prefix is the key asked for.
///
/// - `single` (pass key): a haystack of real text with the sentence "The pass key is 48213.
///   Remember it." inserted at a depth, then the question "What is the pass key?" and the start
///   of the answer "The pass key is", so that greedy decoding continues with the digits.
/// - `multi_key` (RULER's MK-NIAH): `multi_key_count` sentences "The special magic number for
///   <label> is <7 digits>." with distinct labels at distinct depths (the one asked for at the
///   trial's depth, the others at the other depths of (i + 1/2) / count); the question asks for
///   one label's number ("What is the special magic number for <label>?") and the answer starts
///   with "The special magic number for <label> is".
///
/// Prompt text of `single` (haystack cut at a sentence end so the whole prompt fits the context
/// length; `multi_key` has its own first sentences and question):
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
#include <optional>
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

/// Which retrieval task a trial is.
enum class needle_kind : uint8_t {
  single,     ///< one pass key
  multi_key,  ///< several labelled numbers, one asked for (RULER's MK-NIAH)
};

/// "single" or "multi" (the spelling of `--needle-kinds` and of the JSON).
constexpr const char* kind_name(needle_kind k) { return k == needle_kind::multi_key ? "multi" : "single"; }

/// The kind named `name` ("single", "multi"), or nullopt.
std::optional<needle_kind> parse_needle_kind(std::string_view name);

/// Keys of a multi-key trial, and the digits of each.
constexpr int multi_key_count = 4;
constexpr int multi_key_digits = 7;

/// The sentence inserted into the haystack: "The pass key is <key>. Remember it."
std::string needle_sentence(std::string_view key);

/// A multi-key sentence: "The special magic number for <label> is <key>."
std::string multi_key_sentence(std::string_view label, std::string_view key);

/// A key of `digits` decimal digits (first digit non-zero) drawn deterministically from `seed`.
std::string make_key(uint64_t seed, int digits = 5);

/// One labelled key of a multi-key trial besides the one asked for.
struct needle_key {
  std::string label;  ///< e.g. "lantern"
  std::string key;    ///< its digits
  double depth = 0;   ///< fraction (0..1) of the haystack text before it
};

/// One needle trial: what is hidden where, and how long the prompt is.
struct needle_trial {
  int64_t context = 0;  ///< largest prompt length in tokens
  double depth = 0.5;   ///< fraction (0..1) of the haystack text that comes before the needle asked for
  int rep = 0;          ///< repetition index (a different key per repetition)
  std::string key;      ///< the digits to retrieve
  needle_kind kind = needle_kind::single;
  std::string label{};              ///< multi_key: the label whose number is asked for
  std::vector<needle_key> others{};  ///< multi_key: the other labelled numbers (distractors)
};

/// A multi-key trial drawn deterministically from `seed`: `multi_key_count` distinct labels
/// (common English nouns) with distinct numbers of `multi_key_digits` digits; the one asked for
/// (`label`, `key`) at `depth`, the others at the depths (i + 1/2) / count, i = 0 .. count - 1,
/// leaving out the one nearest to `depth`.
needle_trial make_multi_key_trial(int64_t context, double depth, int rep, uint64_t seed);

/// A built prompt.
struct needle_prompt {
  std::vector<kvq::llama::token_id> tokens;  ///< the whole prompt, answer prefix included
  /// Tokens before the question: the haystack part (instructions and text with the needles),
  /// which a run prefills once; tokens[question_start..] are the question and the answer prefix.
  int64_t question_start = 0;
  int64_t haystack_chars = 0;                ///< characters of haystack text used
  int64_t needle_char = 0;                   ///< offset of the needle asked for in the haystack text used
  double depth = 0;                          ///< needle_char / haystack_chars (actual depth)
};

/// Offsets just past each sentence end of `text` (after ". ", "! ", "? ", a closing quote after
/// one of these, or a paragraph break), in increasing order; always ends with text.size().
std::vector<size_t> sentence_ends(std::string_view text);

/// The prompt text (before tokenization, without the chat wrapper) for a haystack cut of `body`
/// with the needles already inserted: the instructions of `kind`, the body, the question (for
/// multi_key about `label`).
std::string needle_question_text(std::string_view body, needle_kind kind = needle_kind::single,
                                 std::string_view label = {});

/// Builds the prompt of `trial` from `haystack` (real text, long enough for the context): the
/// longest whole-sentence prefix of the haystack such that the tokenized prompt has at most
/// `trial.context` tokens, each needle inserted at the sentence boundary nearest to its depth.
/// Errors (invalid_argument): a context too small for the question alone, a haystack too short
/// to fill 90 % of the context, a haystack with no sentence that fits, a depth outside [0, 1],
/// an empty key, a multi_key trial without a label or with a distractor lacking label or key.
kvq::result<needle_prompt> build_needle_prompt(const kvq::llama::tokenizer& tok, std::string_view haystack,
                                               const needle_trial& trial, prompt_template tmpl);

/// The digits of the first run of digits in `text` ("" when there is none).
std::string first_digit_run(std::string_view text);

/// True when the first run of digits in the generated `text` is exactly `key`.
bool needle_passed(std::string_view text, std::string_view key);

}  // namespace kvq::eval
