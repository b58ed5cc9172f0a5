#pragma once
/// \file
/// Tokenizers built from GGUF metadata (`tokenizer.ggml.*`):
///
/// - `llama` (sentencepiece-style BPE with scores, e.g. stories260K): the text gets a leading
///   space (unless `tokenizer.ggml.add_space_prefix` is false), every space becomes "▁" (U+2581),
///   the text is split into UTF-8 characters, and adjacent pieces are merged greedily, the pair
///   whose concatenation is a vocabulary token with the highest score first (leftmost on ties).
///   A character that is no token is written as its UTF-8 bytes, each as the byte-fallback
///   token `<0xXX>`.
/// - `gpt2` (byte-level BPE with merges, e.g. SmolLM2): the text is split by the pre-tokenizer
///   (digits one by one, then the GPT-2 pattern `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
///   ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`), each piece's bytes are mapped to printable characters
///   by GPT-2's byte-to-unicode table, and the merges are applied lowest rank first.
///
/// Control tokens written in the text, like `<|im_start|>`, become their ids when `parse_special`
/// is set; otherwise they are tokenized as plain text. User-defined tokens (Gemma's newline runs
/// "\n", "\n\n", ...) are always split out first, as llama.cpp and HF tokenizers do.

#include <array>
#include <cstdint>
#include <kvq/status.hpp>
#include <llama/gguf.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvq::llama {

/// Token id.
using token_id = int32_t;

/// Which algorithm a vocabulary uses (`tokenizer.ggml.model`).
enum class vocab_kind : uint8_t {
  spm,  ///< "llama": sentencepiece-style, scores, byte fallback
  bpe,  ///< "gpt2": byte-level BPE with merges
};

/// Token attributes of `tokenizer.ggml.token_type`.
enum class token_attr : uint8_t {
  undefined = 0,
  normal = 1,
  unknown = 2,
  control = 3,
  user_defined = 4,
  unused = 5,
  byte = 6,
};

/// A vocabulary with its encoder and decoder. Immutable after creation; safe to share across
/// threads.
class tokenizer {
 public:
  /// Reads the vocabulary of a GGUF file. Errors name the file and the key: missing tokens or
  /// merges, scores or token types of the wrong length, a token type outside 0..6, an unknown
  /// `tokenizer.ggml.model`, BOS/EOS/UNK ids outside the vocabulary, a merge that is not two
  /// tokens separated by a space.
  static result<tokenizer> from_gguf(const gguf_file& f);

  vocab_kind kind() const { return kind_; }
  int32_t n_vocab() const { return int32_t(text_.size()); }
  token_id bos() const { return bos_; }
  token_id eos() const { return eos_; }
  /// The unknown token, or -1.
  token_id unk() const { return unk_; }
  /// Whether the model expects BOS first (`tokenizer.ggml.add_bos_token`; default true for
  /// `llama`, false for `gpt2`).
  bool add_bos() const { return add_bos_; }

  /// Text of a token as stored in the vocabulary ("▁the", "Ġthe", "<0x0A>"); id must be valid.
  const std::string& text(token_id id) const { return text_[size_t(id)]; }
  token_attr attr(token_id id) const { return attr_[size_t(id)]; }
  /// The id of a token text, if any.
  std::optional<token_id> find(std::string_view text) const;

  /// Tokenizes `text`; prepends BOS when `add_bos`. User-defined token texts in `text` become
  /// their ids, and control token texts too with `parse_special`.
  std::vector<token_id> encode(std::string_view text, bool add_bos, bool parse_special = false) const;

  /// The bytes a token stands for: "▁" as a space (spm), GPT-2 characters mapped back to bytes
  /// (bpe), `<0xXX>` as that byte; control tokens as "" unless `render_special`.
  /// Errors: invalid_argument for an id outside the vocabulary.
  result<std::string> piece(token_id id, bool render_special = false) const;
  /// Concatenated pieces of `ids`.
  result<std::string> decode(std::span<const token_id> ids, bool render_special = false) const;

 private:
  tokenizer() = default;
  void encode_fragment(std::string_view text, bool first, std::vector<token_id>& out) const;
  void encode_spm(std::string_view text, std::vector<token_id>& out) const;
  void encode_bpe_word(std::string_view word, std::vector<token_id>& out) const;

  vocab_kind kind_ = vocab_kind::spm;
  std::vector<std::string> text_;
  std::vector<float> score_;
  std::vector<token_attr> attr_;
  std::unordered_map<std::string, token_id> index_;
  std::unordered_map<std::string, int32_t> merge_rank_;  // "left right" -> rank (bpe)
  std::array<std::vector<token_id>, 256> specials_;      // control + user-defined by first byte, longest text first
  std::array<token_id, 256> byte_token_{};               // spm: <0xXX> ids (-1 if absent)
  token_id bos_ = -1, eos_ = -1, unk_ = -1;
  bool add_bos_ = false;
  bool add_space_prefix_ = true;
};

/// One message of a chat.
struct chat_message {
  std::string role;  ///< "system", "user" or "assistant"
  std::string content;
};

/// The system message SmolLM2's chat template inserts when a chat does not start with one.
inline constexpr std::string_view smollm2_default_system =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// SmolLM2's chat template (ChatML) as stored in its `tokenizer.chat_template`: each message as
/// `<|im_start|>{role}\n{content}<|im_end|>\n`, a system message `default_system` first when the
/// chat does not start with one (pass std::nullopt for none), and `<|im_start|>assistant\n` at
/// the end when `add_generation_prompt`. Encode the result with `parse_special = true`.
std::string chatml_prompt(std::span<const chat_message> messages, bool add_generation_prompt = true,
                          std::optional<std::string_view> default_system = smollm2_default_system);

}  // namespace kvq::llama
