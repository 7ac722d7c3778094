// The SAX handler that reads a manifest (manifest.cc) without a document of all its shards.
// Internal to formats/ours.
#pragma once

#include <cstddef>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "base/status.h"
#include "base/text.h"

namespace rs {

// SAX events of a manifest's text, split between the document of everything around the shards
// (`outline`: the top-level 'shards' array stands in it as an empty array, its elements counted)
// and the elements of that array, each handed to `on_shard` as a document of its own.
class ManifestSax {
 public:
  using json = nlohmann::json;
  using OnShard = std::function<Status(const json&, std::size_t)>;
  ManifestSax(json* outline, bool shards, OnShard on_shard = nullptr)
      : outline_(outline), shards_(shards), on_shard_(std::move(on_shard)) {
    if (outline_ != nullptr) dom_.emplace(*outline_, /*allow_exceptions=*/false);
  }
  // The text is the shard list alone (an array of shards), not a whole manifest.
  static ManifestSax ForShardList(OnShard on_shard) {
    ManifestSax sax(nullptr, /*shards=*/true, std::move(on_shard));
    sax.depth_ = 1;
    sax.next_is_shards_ = true;
    return sax;
  }

  bool null() {
    return Value([](auto& d) { return d.null(); });
  }
  bool boolean(bool v) {
    return Value([v](auto& d) { return d.boolean(v); });
  }
  bool number_integer(json::number_integer_t v) {
    return Value([v](auto& d) { return d.number_integer(v); });
  }
  bool number_unsigned(json::number_unsigned_t v) {
    return Value([v](auto& d) { return d.number_unsigned(v); });
  }
  bool number_float(json::number_float_t v, const json::string_t& s) {
    return Value([&](auto& d) { return d.number_float(v, s); });
  }
  bool string(json::string_t& v) {
    return Value([&](auto& d) { return d.string(v); });
  }
  bool binary(json::binary_t& v) {
    return Value([&](auto& d) { return d.binary(v); });
  }
  bool start_object(std::size_t n) {
    return Open([n](auto& d) { return d.start_object(n); });
  }
  bool start_array(std::size_t n) {
    if (depth_ == 1 && next_is_shards_) {
      next_is_shards_ = false;
      in_shards_ = true;
      ++shard_arrays_;
      ++depth_;
      return dom_ ? dom_->start_array(0) : true;
    }
    return Open([n](auto& d) { return d.start_array(n); });
  }
  bool key(json::string_t& k) {
    if (depth_ == 1) next_is_shards_ = k == "shards";
    return Forward([&](auto& d) { return d.key(k); });
  }
  bool end_object() {
    return Close([](auto& d) { return d.end_object(); });
  }
  bool end_array() {
    if (in_shards_ && depth_ == 2) {
      in_shards_ = false;
      --depth_;
      return dom_ ? dom_->end_array() : true;
    }
    return Close([](auto& d) { return d.end_array(); });
  }
  bool parse_error(std::size_t /*pos*/, const std::string& /*token*/, const nlohmann::detail::exception& e) {
    // Not only parse errors: a number too large for a double ("1e999") is out_of_range. The
    // parser quotes the bytes it stopped at, which may be anything (invalid UTF-8, control
    // characters): escaped, so that the message is safe in JSON and on a terminal.
    error_ = "malformed JSON (" + SafeText(e.what()) + ")";
    return false;
  }

  const std::string& error() const { return error_; }
  const Status& status() const { return status_; }  // the first error of on_shard
  std::size_t shard_arrays() const { return shard_arrays_; }
  std::size_t shard_count() const { return count_; }

 private:
  using Dom = nlohmann::detail::json_sax_dom_parser<json>;
  bool InShard() const { return in_shards_ && depth_ >= 3; }
  // A value goes to the shard being built, or to the outline (nowhere else in the shard pass).
  template <typename F>
  bool Forward(F f) {
    if (InShard()) return shards_ ? f(*shard_dom_) : true;
    return dom_ ? f(*dom_) : true;
  }
  template <typename F>
  bool Value(F f) {
    if (in_shards_ && depth_ == 2) return Element([&] { return f(*shard_dom_); }, /*scalar=*/true);
    return Forward(f);
  }
  template <typename F>
  bool Open(F f) {
    if (in_shards_ && depth_ == 2) {
      const bool ok = Element([&] { return f(*shard_dom_); }, /*scalar=*/false);
      ++depth_;
      return ok;
    }
    const bool ok = Forward(f);
    ++depth_;
    return ok;
  }
  template <typename F>
  bool Close(F f) {
    const bool shard = InShard();  // before the depth drops: the closing event is the shard's
    --depth_;
    if (!shard) return dom_ ? f(*dom_) : true;
    if (!shards_) return true;
    const bool ok = f(*shard_dom_);
    return depth_ == 2 ? ok && Done() : ok;
  }
  // An element of the shards array begins (a scalar one is also complete).
  template <typename F>
  bool Element(F first, bool scalar) {
    ++count_;
    if (!shards_) return true;
    shard_ = json();
    shard_dom_.emplace(shard_, /*allow_exceptions=*/false);
    if (!first()) return false;
    return scalar ? Done() : true;
  }
  bool Done() {
    if (!shards_) return true;
    status_ = on_shard_(shard_, count_ - 1);
    shard_dom_.reset();
    shard_ = json();
    return status_.ok();
  }

  json* outline_;
  bool shards_;
  OnShard on_shard_;
  std::optional<Dom> dom_;
  std::optional<Dom> shard_dom_;
  json shard_;
  int depth_ = 0;
  bool next_is_shards_ = false;
  bool in_shards_ = false;
  std::size_t shard_arrays_ = 0;
  std::size_t count_ = 0;
  Status status_;
  std::string error_;
};

}  // namespace rs
