#include <fmt/format.h>

#include <algorithm>
#include <llama/tokenizer.hpp>
#include <queue>

namespace kvq::llama {

namespace {

// ---- UTF-8 and Unicode classes ----------------------------------------------------------------

struct codepoint_range {
  uint32_t first, last;
};
#include "unicode_tables.inc"

bool in_ranges(std::span<const codepoint_range> rs, uint32_t cp) {
  auto it =
      std::upper_bound(rs.begin(), rs.end(), cp, [](uint32_t c, const codepoint_range& r) { return c < r.first; });
  return it != rs.begin() && cp <= std::prev(it)->last;
}

bool is_letter(uint32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return in_ranges(letter_ranges, cp);
}

bool is_number(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return in_ranges(number_ranges, cp);
}

// Unicode White_Space (what `\s` matches in the Unicode-aware regex engines of tokenizers).
bool is_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0d) || cp == 0x20 || cp == 0x85 || cp == 0xa0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

constexpr uint32_t invalid_cp = 0xfffd;

/// One character of a text: its code point and its bytes. Invalid UTF-8 gives one byte per
/// "character" with code point U+FFFD (classified as neither letter, number nor space).
struct utf8_char {
  uint32_t cp;
  uint32_t off;
  uint32_t len;
};

std::vector<utf8_char> split_utf8(std::string_view s) {
  std::vector<utf8_char> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto b0 = uint8_t(s[i]);
    uint32_t len = b0 < 0x80 ? 1 : (b0 >> 5) == 0x6 ? 2 : (b0 >> 4) == 0xe ? 3 : (b0 >> 3) == 0x1e ? 4 : 0;
    uint32_t cp = invalid_cp;
    if (len == 0 || i + len > s.size()) {
      len = 1;
    } else if (len == 1) {
      cp = b0;
    } else {
      cp = b0 & (0x7f >> len);
      bool ok = true;
      for (uint32_t k = 1; k < len; ++k) {
        const auto b = uint8_t(s[i + k]);
        if ((b & 0xc0) != 0x80) ok = false;
        cp = cp << 6 | (b & 0x3f);
      }
      // Reject overlong forms, surrogates and values past U+10FFFF.
      static constexpr uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
      if (!ok || cp < min_cp[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
        cp = invalid_cp;
        len = 1;
      }
    }
    out.push_back({cp, uint32_t(i), len});
    i += len;
  }
  return out;
}

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xc0 | cp >> 6);
    s += char(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    s += char(0xe0 | cp >> 12);
    s += char(0x80 | (cp >> 6 & 0x3f));
    s += char(0x80 | (cp & 0x3f));
  } else {
    s += char(0xf0 | cp >> 18);
    s += char(0x80 | (cp >> 12 & 0x3f));
    s += char(0x80 | (cp >> 6 & 0x3f));
    s += char(0x80 | (cp & 0x3f));
  }
}

// ---- GPT-2 byte <-> unicode ---------------------------------------------------------------------

/// GPT-2's reversible map from bytes to printable code points: the printable Latin-1 bytes
/// (0x21-0x7E, 0xA1-0xAC, 0xAE-0xFF) map to themselves, the other 68 bytes to U+0100.. in order.
struct byte_unicode_map {
  std::array<std::string, 256> to_text;           // byte -> UTF-8 of its code point
  std::unordered_map<uint32_t, uint8_t> to_byte;  // code point -> byte

  byte_unicode_map() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
      const uint32_t cp = printable ? b : next++;
      append_utf8(to_text[b], cp);
      to_byte.emplace(cp, uint8_t(b));
    }
  }
};

const byte_unicode_map& byte_map() {
  static const byte_unicode_map m;
  return m;
}

// ---- pre-tokenizer of the gpt2 vocabulary -----------------------------------------------------

/// Splits `chars[begin, end)` by the GPT-2 pattern
/// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
/// and calls emit(first, last) for each piece (character indices, last exclusive).
template <class Emit>
void gpt2_split(const std::vector<utf8_char>& ch, size_t begin, size_t end, Emit&& emit) {
  auto cp = [&](size_t k) { return ch[k].cp; };
  auto other = [&](uint32_t c) { return !is_space(c) && !is_letter(c) && !is_number(c); };
  size_t i = begin;
  while (i < end) {
    const uint32_t c = cp(i);
    if (c == '\'' && i + 1 < end) {
      const uint32_t c1 = cp(i + 1);
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        emit(i, i + 2);
        i += 2;
        continue;
      }
      if (i + 2 < end) {
        const uint32_t c2 = cp(i + 2);
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
          emit(i, i + 3);
          i += 3;
          continue;
        }
      }
    }
    // ` ?X+` for the three classes X: an optional single space, then a run of one class.
    const size_t j = (c == ' ' && i + 1 < end && !is_space(cp(i + 1))) ? i + 1 : i;
    const uint32_t cj = cp(j);
    if (!is_space(cj)) {
      size_t k = j;
      if (is_letter(cj))
        while (k < end && is_letter(cp(k))) ++k;
      else if (is_number(cj))
        while (k < end && is_number(cp(k))) ++k;
      else
        while (k < end && other(cp(k))) ++k;
      emit(i, k);
      i = k;
      continue;
    }
    // Whitespace: `\s+(?!\S)` keeps the last space of a run for the word after it; `\s+` takes a
    // lone whitespace character.
    size_t k = i;
    while (k < end && is_space(cp(k))) ++k;
    const size_t stop = (k == end || k - i == 1) ? k : k - 1;
    emit(i, stop);
    i = stop;
  }
}

// ---- the merge engine shared by both vocabularies ---------------------------------------------

/// Greedy pair merging over a linked list of symbols (byte ranges of `text`): repeatedly merges
/// the adjacent pair with the highest priority (ties: leftmost), as long as `priority(left,
/// right)` gives one. Returns the surviving symbols as byte ranges.
struct merge_symbol {
  int prev, next;
  uint32_t off, len;
};

template <class Priority>
std::vector<merge_symbol> merge_pairs(std::string_view text, std::vector<merge_symbol> sym, Priority&& priority) {
  struct bigram {
    double prio;
    int left, right;
    uint32_t len;
    bool operator<(const bigram& o) const {  // max-heap: higher priority, then smaller left
      return prio != o.prio ? prio < o.prio : left > o.left;
    }
  };
  std::priority_queue<bigram> queue;
  auto try_add = [&](int l, int r) {
    if (l < 0 || r < 0) return;
    const std::string_view a = text.substr(sym[size_t(l)].off, sym[size_t(l)].len);
    const std::string_view b = text.substr(sym[size_t(r)].off, sym[size_t(r)].len);
    if (auto p = priority(a, b)) queue.push({*p, l, r, uint32_t(a.size() + b.size())});
  };
  for (size_t i = 0; i + 1 < sym.size(); ++i) try_add(int(i), int(i + 1));
  while (!queue.empty()) {
    const bigram g = queue.top();
    queue.pop();
    auto& l = sym[size_t(g.left)];
    auto& r = sym[size_t(g.right)];
    if (l.len == 0 || r.len == 0 || l.next != g.right || l.len + r.len != g.len) continue;  // stale
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) sym[size_t(r.next)].prev = g.left;
    try_add(l.prev, g.left);
    try_add(g.left, l.next);
  }
  std::vector<merge_symbol> out;
  for (int i = sym.empty() ? -1 : 0; i >= 0; i = sym[size_t(i)].next) out.push_back(sym[size_t(i)]);
  return out;
}

std::vector<merge_symbol> char_symbols(std::string_view text) {
  std::vector<merge_symbol> sym;
  const auto chars = split_utf8(text);
  sym.reserve(chars.size());
  for (size_t i = 0; i < chars.size(); ++i)
    sym.push_back({int(i) - 1, i + 1 < chars.size() ? int(i + 1) : -1, chars[i].off, chars[i].len});
  return sym;
}

const std::string space_marker = "\xe2\x96\x81";  // U+2581 "▁"

}  // namespace

// ---- construction -------------------------------------------------------------------------------

result<tokenizer> tokenizer::from_gguf(const gguf_file& f) {
  tokenizer t;
  const std::string& path = f.path();
  auto model = f.get_string("tokenizer.ggml.model");
  if (!model) return model.error();
  if (*model == "llama")
    t.kind_ = vocab_kind::spm;
  else if (*model == "gpt2")
    t.kind_ = vocab_kind::bpe;
  else
    return status{errc::unsupported, fmt::format("{}: tokenizer.ggml.model '{}' is not supported (expected 'llama' "
                                                 "or 'gpt2')",
                                                 path, *model)};

  auto tokens = f.get_string_array("tokenizer.ggml.tokens");
  if (!tokens) return tokens.error();
  t.text_ = std::move(tokens).value();
  const size_t n = t.text_.size();
  if (n == 0 || n > size_t(INT32_MAX))
    return status{errc::io_error, fmt::format("{}: tokenizer.ggml.tokens has {} entries", path, n)};

  if (f.find("tokenizer.ggml.scores")) {
    auto scores = f.get_float_array("tokenizer.ggml.scores");
    if (!scores) return scores.error();
    if (scores->size() != n)
      return status{errc::io_error,
                    fmt::format("{}: tokenizer.ggml.scores has {} entries for {} tokens", path, scores->size(), n)};
    t.score_ = std::move(scores).value();
  } else {
    t.score_.assign(n, 0.f);
  }

  t.attr_.assign(n, token_attr::normal);
  if (f.find("tokenizer.ggml.token_type")) {
    auto types = f.get_int_array("tokenizer.ggml.token_type");
    if (!types) return types.error();
    if (types->size() != n)
      return status{errc::io_error,
                    fmt::format("{}: tokenizer.ggml.token_type has {} entries for {} tokens", path, types->size(), n)};
    for (size_t i = 0; i < n; ++i) {
      const int64_t v = (*types)[i];
      if (v < 0 || v > 6)
        return status{errc::io_error,
                      fmt::format("{}: tokenizer.ggml.token_type[{}] = {} is not a token type (0..6)", path, i, v)};
      t.attr_[i] = token_attr(v);
    }
  }

  t.index_.reserve(n);
  for (size_t i = 0; i < n; ++i) t.index_.emplace(t.text_[i], token_id(i));  // first wins

  auto id_key = [&](const char* key, token_id fallback, token_id& out) -> status {
    auto v = f.get_int_or(key, fallback);
    if (!v) return v.error();
    if (*v < -1 || *v >= int64_t(n))
      return {errc::io_error, fmt::format("{}: {} = {} is outside the vocabulary of {} tokens", path, key, *v, n)};
    out = token_id(*v);
    return {};
  };
  KVQ_TRY(id_key("tokenizer.ggml.bos_token_id", -1, t.bos_));
  KVQ_TRY(id_key("tokenizer.ggml.eos_token_id", -1, t.eos_));
  KVQ_TRY(id_key("tokenizer.ggml.unknown_token_id", -1, t.unk_));

  auto add_bos = f.get_bool_or("tokenizer.ggml.add_bos_token", t.kind_ == vocab_kind::spm);
  if (!add_bos) return add_bos.error();
  t.add_bos_ = *add_bos && t.bos_ >= 0;
  auto space_prefix = f.get_bool_or("tokenizer.ggml.add_space_prefix", t.kind_ == vocab_kind::spm);
  if (!space_prefix) return space_prefix.error();
  t.add_space_prefix_ = *space_prefix;

  t.byte_token_.fill(-1);
  for (int b = 0; b < 256; ++b)
    if (auto id = t.find(fmt::format("<0x{:02X}>", b))) t.byte_token_[size_t(b)] = *id;

  if (t.kind_ == vocab_kind::bpe) {
    auto merges = f.get_string_array("tokenizer.ggml.merges");
    if (!merges) return merges.error();
    t.merge_rank_.reserve(merges->size());
    for (size_t i = 0; i < merges->size(); ++i) {
      const std::string& m = (*merges)[i];
      const size_t sp = m.find(' ', 1);
      if (sp == std::string::npos || sp + 1 >= m.size())
        return status{errc::io_error, fmt::format("{}: tokenizer.ggml.merges[{}] = '{}' is not two tokens separated by "
                                                  "a space",
                                                  path, i, m)};
      t.merge_rank_.emplace(m, int32_t(i));  // first wins
    }
  }

  for (size_t i = 0; i < n; ++i)
    if ((t.attr_[i] == token_attr::control || t.attr_[i] == token_attr::user_defined) && !t.text_[i].empty())
      t.specials_[uint8_t(t.text_[i][0])].push_back(token_id(i));
  for (auto& list : t.specials_)
    std::stable_sort(list.begin(), list.end(),
                     [&](token_id a, token_id b) { return t.text_[size_t(a)].size() > t.text_[size_t(b)].size(); });
  return t;
}

std::optional<token_id> tokenizer::find(std::string_view text) const {
  auto it = index_.find(std::string(text));
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

// ---- encoding -----------------------------------------------------------------------------------

std::vector<token_id> tokenizer::encode(std::string_view text, bool add_bos, bool parse_special) const {
  std::vector<token_id> out;
  if (add_bos && bos_ >= 0) out.push_back(bos_);
  // Split on special-token texts (longest match at each position), encode the text between.
  // User-defined tokens (Gemma's runs of newlines, for one) are split out always, as llama.cpp
  // and HF tokenizers do; control tokens only with parse_special.
  size_t start = 0, i = 0;
  while (i < text.size()) {
    token_id hit = -1;
    for (token_id s : specials_[uint8_t(text[i])]) {
      const std::string& st = text_[size_t(s)];
      if ((parse_special || attr_[size_t(s)] == token_attr::user_defined) && text.compare(i, st.size(), st) == 0) {
        hit = s;
        break;
      }
    }
    if (hit < 0) {
      ++i;
      continue;
    }
    if (i > start) encode_fragment(text.substr(start, i - start), start == 0, out);
    out.push_back(hit);
    i += text_[size_t(hit)].size();
    start = i;
  }
  if (start < text.size()) encode_fragment(text.substr(start), start == 0, out);
  return out;
}

void tokenizer::encode_fragment(std::string_view text, bool first, std::vector<token_id>& out) const {
  if (text.empty()) return;  // no space prefix for an empty text either
  if (kind_ == vocab_kind::spm) {
    // The space prefix goes only before the text that starts the input.
    std::string s;
    s.reserve(text.size() * 3 + 3);
    if (first && add_space_prefix_) s += space_marker;
    for (char c : text) {
      if (c == ' ')
        s += space_marker;
      else
        s += c;
    }
    encode_spm(s, out);
    return;
  }
  // bpe: digits one by one, then the GPT-2 split of the text between them.
  const auto chars = split_utf8(text);
  auto word = [&](size_t a, size_t b) {
    const size_t off = chars[a].off, end = b < chars.size() ? chars[b].off : text.size();
    encode_bpe_word(text.substr(off, end - off), out);
  };
  size_t seg = 0;
  for (size_t i = 0; i <= chars.size(); ++i) {
    if (i < chars.size() && !is_number(chars[i].cp)) continue;
    if (i > seg) gpt2_split(chars, seg, i, word);
    if (i < chars.size()) word(i, i + 1);
    seg = i + 1;
  }
}

void tokenizer::encode_spm(std::string_view text, std::vector<token_id>& out) const {
  if (text.empty()) return;
  auto sym =
      merge_pairs(text, char_symbols(text), [&](std::string_view a, std::string_view b) -> std::optional<double> {
        std::string m;
        m.reserve(a.size() + b.size());
        m.append(a).append(b);
        auto id = find(m);
        if (!id) return std::nullopt;
        return double(score_[size_t(*id)]);
      });
  for (const auto& s : sym) {
    const std::string_view piece = text.substr(s.off, s.len);
    if (auto id = find(piece)) {
      out.push_back(*id);
      continue;
    }
    for (char c : piece) {  // byte fallback
      const token_id b = byte_token_[uint8_t(c)];
      if (b >= 0)
        out.push_back(b);
      else if (unk_ >= 0)
        out.push_back(unk_);
    }
  }
}

void tokenizer::encode_bpe_word(std::string_view word, std::vector<token_id>& out) const {
  if (word.empty()) return;
  const auto& bm = byte_map();
  std::string mapped;
  mapped.reserve(word.size() * 2);
  for (char c : word) mapped += bm.to_text[uint8_t(c)];
  auto sym =
      merge_pairs(mapped, char_symbols(mapped), [&](std::string_view a, std::string_view b) -> std::optional<double> {
        std::string key;
        key.reserve(a.size() + b.size() + 1);
        key.append(a).append(1, ' ').append(b);
        auto it = merge_rank_.find(key);
        if (it == merge_rank_.end()) return std::nullopt;
        return -double(it->second);  // lower rank first
      });
  for (const auto& s : sym) {
    const std::string_view piece = std::string_view(mapped).substr(s.off, s.len);
    if (auto id = find(piece)) {
      out.push_back(*id);
      continue;
    }
    // No token for the merged piece: one token per mapped byte character.
    for (const auto& ch : split_utf8(piece)) {
      if (auto id = find(piece.substr(ch.off, ch.len)))
        out.push_back(*id);
      else if (unk_ >= 0)
        out.push_back(unk_);
    }
  }
}

// ---- decoding -----------------------------------------------------------------------------------

result<std::string> tokenizer::piece(token_id id, bool render_special) const {
  if (id < 0 || id >= n_vocab())
    return status{errc::invalid_argument,
                  fmt::format("token id {} is outside the vocabulary of {} tokens", id, n_vocab())};
  const std::string& t = text_[size_t(id)];
  switch (attr_[size_t(id)]) {
    case token_attr::control:
    case token_attr::unknown:
    case token_attr::unused:
      return render_special ? t : std::string();
    case token_attr::byte:
      for (int b = 0; b < 256; ++b)
        if (byte_token_[size_t(b)] == id) return std::string(1, char(b));
      return t;
    case token_attr::user_defined:
      return t;
    case token_attr::undefined:
    case token_attr::normal:
      break;
  }
  std::string out;
  if (kind_ == vocab_kind::spm) {
    for (size_t i = 0; i < t.size();) {
      if (t.compare(i, space_marker.size(), space_marker) == 0) {
        out += ' ';
        i += space_marker.size();
      } else {
        out += t[i++];
      }
    }
    return out;
  }
  const auto& bm = byte_map();
  for (const auto& ch : split_utf8(t)) {
    auto it = bm.to_byte.find(ch.cp);
    if (it != bm.to_byte.end())
      out += char(it->second);
    else
      out.append(t, ch.off, ch.len);  // not a byte character: keep as is
  }
  return out;
}

result<std::string> tokenizer::decode(std::span<const token_id> ids, bool render_special) const {
  std::string out;
  for (token_id id : ids) {
    auto p = piece(id, render_special);
    if (!p) return p.error();
    out += *p;
  }
  return out;
}

// ---- chat template ------------------------------------------------------------------------------

std::string chatml_prompt(std::span<const chat_message> messages, bool add_generation_prompt,
                          std::optional<std::string_view> default_system) {
  std::string s;
  if (default_system && !messages.empty() && messages.front().role != "system")
    s += fmt::format("<|im_start|>system\n{}<|im_end|>\n", *default_system);
  for (const auto& m : messages) s += fmt::format("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content);
  if (add_generation_prompt) s += "<|im_start|>assistant\n";
  return s;
}

}  // namespace kvq::llama
