// The safetensors format (what HF `transformers` loads): an 8-byte little-endian
// header length N, N bytes of JSON {"name": {"dtype", "shape", "data_offsets":
// [begin, end]}, ..., "__metadata__": {str: str}} padded with spaces so the data
// starts 8-byte aligned, then the tensors' bytes (row-major, little-endian),
// indexed without holes or overlaps. Errors throw CheckpointError naming the file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace spes {

// A tensor held as fp32 whatever its on-disk dtype ("F32" or "BF16" when
// written; "F32", "BF16" or "F16" when read).
struct SafeTensor {
  std::string name;
  std::string dtype = "F32";
  std::vector<int64_t> shape;
  std::vector<float> data;
};

struct SafeTensorsFile {
  std::vector<SafeTensor> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  const SafeTensor* find(const std::string& name) const;
};

// A tensor to write, viewing memory the caller owns (no copy of a whole model).
struct SafeTensorView {
  std::string name;
  std::string dtype = "F32";  // stored dtype: "F32" or "BF16" (rounded to nearest even)
  std::vector<int64_t> shape;
  const float* data = nullptr;  // numel(shape) floats
};

// Writes atomically (temp file + fsync + rename). Tensors are laid out by element
// size, largest first, as the reference writer does, so every tensor is aligned.
void write_safetensors(const std::string& path, std::span<const SafeTensorView> tensors,
                       const std::map<std::string, std::string>& metadata = {});
void write_safetensors(const std::string& path, const std::vector<SafeTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

SafeTensorsFile read_safetensors(const std::string& path);

// Random access without loading everything: the file is mapped and its header
// fully validated on open (length vs file size, JSON, known dtypes, shapes vs
// byte lengths, offsets in bounds, no overlaps or holes, no duplicate names).
class SafeTensorsReader {
 public:
  struct Entry {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // byte offsets into the data buffer
    int64_t numel = 1;
  };

  explicit SafeTensorsReader(const std::string& path);
  ~SafeTensorsReader();
  SafeTensorsReader(const SafeTensorsReader&) = delete;
  SafeTensorsReader& operator=(const SafeTensorsReader&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<Entry>& entries() const { return entries_; }  // in data order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const Entry* find(const std::string& name) const;
  // Converts to fp32 into dst (entry.numel floats); F32, BF16 and F16 convert.
  void read(const Entry& e, float* dst) const;
  std::vector<float> read(const Entry& e) const;

 private:
  [[noreturn]] void fail(const std::string& what) const;
  std::string path_;
  const unsigned char* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* data_ = nullptr;  // start of the byte buffer
  std::vector<Entry> entries_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Bytes per element of a safetensors dtype name, or 0 when it is not one.
size_t safetensors_dtype_size(const std::string& dtype);

// bf16 <-> fp32 (round to nearest even; NaN stays NaN).
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t b);

}  // namespace spes
