#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <eval/needle.hpp>

namespace kvq::eval {

namespace {

constexpr std::string_view intro =
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n";
constexpr std::string_view question = "\n\nWhat is the pass key?";
constexpr std::string_view answer_prefix = "The pass key is";

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

/// `text` with the needle inserted at offset `at` (0 or a sentence end).
std::string insert_needle(std::string_view text, size_t at, std::string_view needle) {
  std::string out;
  out.reserve(text.size() + needle.size() + 2);
  if (at == 0) {
    out += needle;
    out += ' ';
    size_t i = 0;
    while (i < text.size() && is_space(text[i])) ++i;
    out += text.substr(i);
  } else {
    out += text.substr(0, at);
    out += ' ';
    out += needle;
    out += text.substr(at);
  }
  return out;
}

std::vector<kvq::llama::token_id> encode_prompt(const kvq::llama::tokenizer& tok, std::string_view body,
                                                prompt_template tmpl) {
  const std::string text = needle_question_text(body);
  if (tmpl == prompt_template::chatml) {
    const std::vector<kvq::llama::chat_message> chat = {{"user", text}};
    std::string s = kvq::llama::chatml_prompt(chat);
    s += answer_prefix;
    return tok.encode(s, tok.add_bos(), true);
  }
  return tok.encode(text + " " + std::string(answer_prefix), tok.add_bos(), false);
}

}  // namespace

std::string needle_sentence(std::string_view key) { return fmt::format("The pass key is {}. Remember it.", key); }

std::string make_key(uint64_t seed, int digits) {
  uint64_t state = seed;
  std::string key;
  for (int i = 0; i < std::max(digits, 1); ++i) {
    const uint64_t r = splitmix64(state);
    key += char(i == 0 ? '1' + r % 9 : '0' + r % 10);
  }
  return key;
}

std::vector<size_t> sentence_ends(std::string_view text) {
  std::vector<size_t> ends;
  for (size_t i = 0; i + 1 < text.size(); ++i) {
    const char c = text[i];
    if (c == '.' || c == '!' || c == '?') {
      size_t e = i + 1;
      if (e < text.size() && (text[e] == '"' || text[e] == '\'')) ++e;
      if (e < text.size() && is_space(text[e])) ends.push_back(e);
    } else if (c == '\n' && text[i + 1] == '\n' && i > 0 && !is_space(text[i - 1])) {
      ends.push_back(i);
    }
  }
  std::sort(ends.begin(), ends.end());
  ends.erase(std::unique(ends.begin(), ends.end()), ends.end());
  if (ends.empty() || ends.back() != text.size()) ends.push_back(text.size());
  return ends;
}

std::string needle_question_text(std::string_view body) {
  std::string s(intro);
  s += body;
  s += question;
  return s;
}

kvq::result<needle_prompt> build_needle_prompt(const kvq::llama::tokenizer& tok, std::string_view haystack,
                                               const needle_trial& trial, prompt_template tmpl) {
  if (trial.key.empty()) return kvq::status{kvq::errc::invalid_argument, "needle: empty pass key"};
  if (!(trial.depth >= 0 && trial.depth <= 1))
    return kvq::status{kvq::errc::invalid_argument, fmt::format("needle: depth {} is outside [0, 1]", trial.depth)};
  const std::string needle = needle_sentence(trial.key);
  const int64_t overhead = int64_t(encode_prompt(tok, needle, tmpl).size());
  if (overhead > trial.context)
    return kvq::status{kvq::errc::invalid_argument,
                       fmt::format("needle: context {} is too small; the question and the needle alone take {} tokens",
                                   trial.context, overhead)};
  const std::vector<size_t> ends = sentence_ends(haystack);

  // The prompt for the haystack cut at ends[j], needle at the boundary nearest to depth.
  auto build = [&](size_t j, needle_prompt& out) {
    const size_t cut = ends[j];
    const double target = trial.depth * double(cut);
    size_t at = 0;
    double best = target;  // distance of boundary 0
    for (size_t i = 0; i <= j; ++i) {
      const double d = std::abs(double(ends[i]) - target);
      if (d < best) best = d, at = ends[i];
    }
    const std::string body = insert_needle(haystack.substr(0, cut), at, needle);
    out.tokens = encode_prompt(tok, body, tmpl);
    out.haystack_chars = int64_t(cut);
    out.needle_char = int64_t(at);
    out.depth = cut ? double(at) / double(cut) : 0.0;
  };

  // Largest j whose prompt fits (token counts grow with j).
  needle_prompt best;
  int64_t lo = 0, hi = int64_t(ends.size()) - 1, found = -1;
  while (lo <= hi) {
    const int64_t mid = (lo + hi) / 2;
    needle_prompt p;
    build(size_t(mid), p);
    if (int64_t(p.tokens.size()) <= trial.context) {
      found = mid;
      best = std::move(p);
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  if (found < 0)
    return kvq::status{
        kvq::errc::invalid_argument,
        fmt::format("needle: not even the haystack's first sentence fits a context of {} tokens", trial.context)};
  if (size_t(found) + 1 == ends.size() && double(best.tokens.size()) < 0.9 * double(trial.context))
    return kvq::status{kvq::errc::invalid_argument,
                       fmt::format("needle: the haystack is too short for a context of {} tokens (all of it gives a "
                                   "prompt of {} tokens); use a longer haystack text",
                                   trial.context, best.tokens.size())};
  return best;
}

std::string first_digit_run(std::string_view text) {
  size_t i = 0;
  while (i < text.size() && !std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  size_t j = i;
  while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
  return std::string(text.substr(i, j - i));
}

bool needle_passed(std::string_view text, std::string_view key) { return !key.empty() && first_digit_run(text) == key; }

}  // namespace kvq::eval
