// A small SVG 1.1 writer for the pictures the tool draws (pictures/pictures.h). Output is
// deterministic – elements in the order they are added, numbers printed with at most two
// decimals and never in exponent form – so the same input gives the same bytes, and pictures
// can be compared and checked into a repository. Text and attribute values are XML-escaped.
//
// Every element the pictures draw for a piece of data also carries that data in `data-*`
// attributes (a shard's rank and box, a cell's bytes), so tests and scripts can read a picture
// back with any XML parser instead of trusting its geometry.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace rs::svg {

// Attributes in the order given.
using Attrs = std::vector<std::pair<std::string, std::string>>;

// "12.5", "0", "-3.25", "1234567": rounded to two decimals, trailing zeros dropped.
std::string Num(double v);
// &, <, >, " and ' as entities; invalid UTF-8 and control characters other than tab and
// newline as "\xNN" text (SafeText, base/text.h), since XML 1.0 cannot carry them.
std::string Escape(std::string_view text);

// A categorical colour for index i: 20 well-separated colours, then hues by the golden angle.
std::string Color(std::int64_t i);
// A sequential ramp for heat maps: t = 0 very light, t = 1 dark (clamped to [0, 1]).
std::string Ramp(double t);

class Document {
 public:
  // A picture of width × height user units (pixels), with a <title> for viewers and screen
  // readers, on a white background.
  Document(double width, double height, std::string_view title);

  void Rect(double x, double y, double w, double h, const Attrs& attrs = {});
  void Line(double x1, double y1, double x2, double y2, const Attrs& attrs = {});
  // Points as "x,y x,y ...".
  void Polyline(std::span<const std::pair<double, double>> points, const Attrs& attrs = {});
  void Polygon(std::span<const std::pair<double, double>> points, const Attrs& attrs = {});
  void Text(double x, double y, std::string_view text, const Attrs& attrs = {});
  // A group (<g>) or any container element; Close ends the most recently opened one.
  void Open(std::string_view tag, const Attrs& attrs = {});
  void Close();
  // A <title> child of the element opened last: the tooltip a viewer shows for it.
  void Tooltip(std::string_view text);

  // The whole document; closes what is still open. The document is finished afterwards.
  std::string Finish();

 private:
  void Element(std::string_view tag, const Attrs& geometry, const Attrs& attrs);
  std::string out_;
  std::vector<std::string> open_;
};

}  // namespace rs::svg
