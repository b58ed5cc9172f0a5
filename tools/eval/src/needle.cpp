#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <eval/needle.hpp>
#include <iterator>
#include <tuple>
#include <utility>

namespace kvq::eval {

namespace {

constexpr std::string_view intro =
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n";
constexpr std::string_view question = "\n\nWhat is the pass key?";
constexpr std::string_view answer_prefix = "The pass key is";

constexpr std::string_view multi_intro =
    "Some special magic numbers are hidden inside a lot of irrelevant text. Find them and memorize them. "
    "I will quiz you about one of them.\n\n";

/// Labels of multi-key trials: common nouns, one token or two, none of them in the haystack's
/// sense as a name.
constexpr std::string_view labels[] = {"apple",  "river",  "lantern", "falcon", "marble", "violet",
                                       "harbor", "copper", "meadow",  "pebble", "orchid", "glacier",
                                       "saddle", "cobalt", "willow",  "anchor"};

std::string_view intro_of(needle_kind kind) { return kind == needle_kind::multi_key ? multi_intro : intro; }

std::string question_of(needle_kind kind, std::string_view label) {
  return kind == needle_kind::multi_key ? fmt::format("\n\nWhat is the special magic number for {}?", label)
                                        : std::string(question);
}

std::string answer_of(needle_kind kind, std::string_view label) {
  return kind == needle_kind::multi_key ? fmt::format("The special magic number for {} is", label)
                                        : std::string(answer_prefix);
}

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

/// A sentence to insert at offset `at` of the haystack text (0 or a sentence end).
struct insertion {
  size_t at = 0;
  std::string sentence;
};

/// `text` with the sentences inserted, `ins` sorted by offset (equal offsets keep their order):
/// at 0 a sentence comes first, followed by a space (leading whitespace of the text dropped);
/// elsewhere it follows a space after the sentence end.
std::string insert_needles(std::string_view text, const std::vector<insertion>& ins) {
  std::string out;
  size_t prev = 0;
  bool at_start = true;
  for (const auto& in : ins) {
    if (in.at == 0) {
      out += in.sentence;
      out += ' ';
      continue;
    }
    if (at_start && !out.empty())
      while (prev < text.size() && is_space(text[prev])) ++prev;
    at_start = false;
    const size_t at = std::max(in.at, prev);
    out += text.substr(prev, at - prev);
    out += ' ';
    out += in.sentence;
    prev = at;
  }
  if (at_start && !out.empty())
    while (prev < text.size() && is_space(text[prev])) ++prev;
  out += text.substr(prev);
  return out;
}

/// The whole prompt string of `body` and the length of its part before the question.
std::pair<std::string, size_t> prompt_string(std::string_view body, prompt_template tmpl, needle_kind kind,
                                             std::string_view label) {
  const std::string text = needle_question_text(body, kind, label);
  const size_t question_at = intro_of(kind).size() + body.size();
  if (tmpl == prompt_template::chatml) {
    const std::vector<kvq::llama::chat_message> chat = {{"user", text}};
    std::string s = kvq::llama::chatml_prompt(chat);
    const size_t user_at = s.find(text);
    s += answer_of(kind, label);
    return {std::move(s), user_at + question_at};
  }
  return {text + " " + answer_of(kind, label), question_at};
}

std::vector<kvq::llama::token_id> encode(const kvq::llama::tokenizer& tok, std::string_view s, prompt_template tmpl) {
  return tok.encode(s, tok.add_bos(), tmpl == prompt_template::chatml);
}

}  // namespace

std::optional<needle_kind> parse_needle_kind(std::string_view name) {
  if (name == "single") return needle_kind::single;
  if (name == "multi") return needle_kind::multi_key;
  return std::nullopt;
}

std::string needle_sentence(std::string_view key) { return fmt::format("The pass key is {}. Remember it.", key); }

std::string multi_key_sentence(std::string_view label, std::string_view key) {
  return fmt::format("The special magic number for {} is {}.", label, key);
}

needle_trial make_multi_key_trial(int64_t context, double depth, int rep, uint64_t seed) {
  constexpr size_t n_labels = std::size(labels);
  static_assert(multi_key_count <= int(n_labels));
  uint64_t state = seed;
  std::vector<std::string> names, keys;
  while (int(names.size()) < multi_key_count) {
    const std::string_view l = labels[splitmix64(state) % n_labels];
    if (std::find(names.begin(), names.end(), l) == names.end()) names.emplace_back(l);
  }
  while (int(keys.size()) < multi_key_count) {
    std::string k = make_key(splitmix64(state), multi_key_digits);
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(std::move(k));
  }
  needle_trial t{context, depth, rep, keys[0], needle_kind::multi_key, names[0], {}};
  // The distractors take the evenly spread depths but the one nearest to the asked key's.
  int nearest = 0;
  for (int i = 1; i < multi_key_count; ++i)
    if (std::abs((i + 0.5) / multi_key_count - depth) < std::abs((nearest + 0.5) / multi_key_count - depth))
      nearest = i;
  for (int i = 0, next = 1; i < multi_key_count; ++i)
    if (i != nearest) {
      t.others.push_back({names[size_t(next)], keys[size_t(next)], (i + 0.5) / multi_key_count});
      ++next;
    }
  return t;
}

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

std::string needle_question_text(std::string_view body, needle_kind kind, std::string_view label) {
  std::string s(intro_of(kind));
  s += body;
  s += question_of(kind, label);
  return s;
}

kvq::result<needle_prompt> build_needle_prompt(const kvq::llama::tokenizer& tok, std::string_view haystack,
                                               const needle_trial& trial, prompt_template tmpl) {
  auto bad = [](std::string msg) { return kvq::status{kvq::errc::invalid_argument, std::move(msg)}; };
  if (trial.key.empty()) return bad("needle: empty pass key");
  const bool multi = trial.kind == needle_kind::multi_key;
  if (multi && trial.label.empty()) return bad("needle: multi-key trial without the label asked for");
  // The needles (the one asked for first) with their requested depths.
  std::vector<std::pair<double, std::string>> needles;
  needles.emplace_back(trial.depth, multi ? multi_key_sentence(trial.label, trial.key) : needle_sentence(trial.key));
  if (multi)
    for (const auto& o : trial.others) {
      if (o.label.empty() || o.key.empty()) return bad("needle: a multi-key distractor without label or key");
      needles.emplace_back(o.depth, multi_key_sentence(o.label, o.key));
    }
  for (const auto& [d, sentence] : needles)
    if (!(d >= 0 && d <= 1)) return bad(fmt::format("needle: depth {} is outside [0, 1]", d));
  std::string all_needles;
  for (const auto& n : needles) all_needles += (all_needles.empty() ? "" : " ") + n.second;
  const int64_t overhead =
      int64_t(encode(tok, prompt_string(all_needles, tmpl, trial.kind, trial.label).first, tmpl).size());
  if (overhead > trial.context)
    return kvq::status{kvq::errc::invalid_argument,
                       fmt::format("needle: context {} is too small; the question and the needle alone take {} tokens",
                                   trial.context, overhead)};
  const std::vector<size_t> ends = sentence_ends(haystack);

  // The prompt for the haystack cut at ends[j], each needle at the boundary nearest to its depth.
  std::string prompt_text;
  size_t question_at = 0;
  auto build = [&](size_t j, needle_prompt& out) {
    const size_t cut = ends[j];
    std::vector<insertion> ins;
    for (const auto& [depth, sentence] : needles) {
      const double target = depth * double(cut);
      size_t at = 0;
      double best = target;  // distance of boundary 0
      for (size_t i = 0; i <= j; ++i) {
        const double d = std::abs(double(ends[i]) - target);
        if (d < best) best = d, at = ends[i];
      }
      ins.push_back({at, sentence});
    }
    out.needle_char = int64_t(ins.front().at);
    std::stable_sort(ins.begin(), ins.end(), [](const insertion& a, const insertion& b) { return a.at < b.at; });
    const std::string body = insert_needles(haystack.substr(0, cut), ins);
    std::tie(prompt_text, question_at) = prompt_string(body, tmpl, trial.kind, trial.label);
    out.tokens = encode(tok, prompt_text, tmpl);
    out.haystack_chars = int64_t(cut);
    out.depth = cut ? double(out.needle_char) / double(cut) : 0.0;
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
  // The haystack part: the tokens the prompt shares with the tokenization of its text up to the
  // question (the same tokens unless a merge crosses that boundary).
  build(size_t(found), best);
  const auto head = encode(tok, std::string_view(prompt_text).substr(0, question_at), tmpl);
  const auto mismatch = std::mismatch(head.begin(), head.end(), best.tokens.begin(), best.tokens.end());
  best.question_start = int64_t(mismatch.first - head.begin());
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
