#include "pictures/svg.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>

#include "base/check.h"
#include "base/text.h"

namespace rs::svg {

std::string Num(double v) {
  if (!std::isfinite(v)) return "0";
  const double r = std::round(v * 100.0) / 100.0;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", r == 0.0 ? 0.0 : r);  // no "-0"
  std::string s = buf;
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

std::string Escape(std::string_view raw) {
  // Names come from files: bytes that are not UTF-8 and control characters (which XML 1.0
  // cannot carry) are written as "\xNN" text first.
  const std::string text = SafeText(raw, /*keep_newlines=*/true);
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string Color(std::int64_t i) {
  // Tableau 20, reordered so that neighbouring indices differ in hue first, then in lightness.
  static constexpr std::array<const char*, 20> kPalette = {
      "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f", "#bab0ac",
      "#a0cbe8", "#ffbe7d", "#8cd17d", "#ff9d9a", "#d4a6c8", "#86bcb6", "#f1ce63", "#fabfd2", "#d7b5a6", "#79706e"};
  if (i >= 0 && i < static_cast<std::int64_t>(kPalette.size())) return kPalette[static_cast<std::size_t>(i)];
  // Beyond the palette: hues 137.5° apart, lightness in three bands.
  const auto u = static_cast<std::uint64_t>(i);
  const double hue = std::fmod(static_cast<double>(u % 100000) * 137.50776405, 360.0);
  const int light = 45 + static_cast<int>(u % 3) * 12;
  char buf[48];
  std::snprintf(buf, sizeof buf, "hsl(%.1f,55%%,%d%%)", hue, light);
  return buf;
}

std::string Ramp(double t) {
  t = std::clamp(std::isfinite(t) ? t : 0.0, 0.0, 1.0);
  // From #f7fbff to #08306b (a light-to-dark blue), linear in sRGB.
  const auto mix = [t](int a, int b) { return static_cast<int>(std::lround(a + (b - a) * t)); };
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", mix(0xf7, 0x08), mix(0xfb, 0x30), mix(0xff, 0x6b));
  return buf;
}

Document::Document(double width, double height, std::string_view title) {
  out_ = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  out_ += "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" + Num(width) + "\" height=\"" +
          Num(height) + "\" viewBox=\"0 0 " + Num(width) + " " + Num(height) +
          "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"11\">\n";
  out_ += "<title>" + Escape(title) + "</title>\n";
  out_ += "<rect x=\"0\" y=\"0\" width=\"" + Num(width) + "\" height=\"" + Num(height) + "\" fill=\"#ffffff\"/>\n";
  open_.push_back("svg");
}

void Document::Element(std::string_view tag, const Attrs& geometry, const Attrs& attrs) {
  RS_CHECK(!open_.empty());  // not finished
  out_ += '<';
  out_ += tag;
  for (const Attrs* list : {&geometry, &attrs}) {
    for (const auto& [k, v] : *list) out_ += " " + k + "=\"" + Escape(v) + "\"";
  }
}

void Document::Rect(double x, double y, double w, double h, const Attrs& attrs) {
  Element("rect", {{"x", Num(x)}, {"y", Num(y)}, {"width", Num(std::max(0.0, w))}, {"height", Num(std::max(0.0, h))}},
          attrs);
  out_ += "/>\n";
}

void Document::Line(double x1, double y1, double x2, double y2, const Attrs& attrs) {
  Element("line", {{"x1", Num(x1)}, {"y1", Num(y1)}, {"x2", Num(x2)}, {"y2", Num(y2)}}, attrs);
  out_ += "/>\n";
}

namespace {
std::string Points(std::span<const std::pair<double, double>> points) {
  std::string s;
  for (const auto& [x, y] : points) {
    if (!s.empty()) s += ' ';
    s += Num(x) + "," + Num(y);
  }
  return s;
}
}  // namespace

void Document::Polyline(std::span<const std::pair<double, double>> points, const Attrs& attrs) {
  Element("polyline", {{"points", Points(points)}, {"fill", "none"}}, attrs);
  out_ += "/>\n";
}

void Document::Polygon(std::span<const std::pair<double, double>> points, const Attrs& attrs) {
  Element("polygon", {{"points", Points(points)}}, attrs);
  out_ += "/>\n";
}

void Document::Text(double x, double y, std::string_view text, const Attrs& attrs) {
  Element("text", {{"x", Num(x)}, {"y", Num(y)}}, attrs);
  out_ += '>';
  out_ += Escape(text);
  out_ += "</text>\n";
}

void Document::Open(std::string_view tag, const Attrs& attrs) {
  Element(tag, {}, attrs);
  out_ += ">\n";
  open_.emplace_back(tag);
}

void Document::Close() {
  RS_CHECK(open_.size() > 1);  // the <svg> element closes in Finish
  out_ += "</" + open_.back() + ">\n";
  open_.pop_back();
}

void Document::Tooltip(std::string_view text) { out_ += "<title>" + Escape(text) + "</title>\n"; }

std::string Document::Finish() {
  while (!open_.empty()) {
    out_ += "</" + open_.back() + ">\n";
    open_.pop_back();
  }
  return std::move(out_);
}

}  // namespace rs::svg
