// Zero-copy reads of the store's pinned host tier by a GPU kernel, against a bulk host-to-device
// copy measured in the same run: how fast do the rows a sparse method selects cross PCIe/C2C?
//
//   host_tier_bench [--tokens=32768] [--layers=8] [--densities=0.01,0.05,0.1] [--reps=20]
//                   [--group_rows=512,190]
//
// The store (pinned, mapped pages; Llama-3.1-8B kv shapes: 8 kv heads, d = 128, bf16) holds
// `layers` layers of `tokens` tokens. A call reads, for every kv head of one layer (rotating),
// the rows of a uniformly random `density` of the tokens: the token's K and V together (512 B,
// adjacent in the page: HashAttention / vAttention placement) or its V alone (256 B: S2ANTA).
// Timed with CUDA events around the gather kernel alone (median); the host's work to list the
// rows' addresses from a PageView is timed separately and reported.
//
// With --group_rows (e.g. 512,190): S2ANTA's group mixture's read as the engine does it
// (SelectedRowsDecode in place, shared_rows: the 4 query heads of each kv head over one list of
// rows read once from the store's pages through their page lists), for that many distinct tokens
// a kv head, each call on the next layer, its pages cold (not read since the other layers were)
// and warm (every page of the layer read once just before, WarmPagedRows), beside the gather
// kernel over the same rows' slots: whether the engine's read is slow by its memory or by its
// kernel (docs/PERF.md, "`flash`'s step beside the group mixture's").
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/cuda/gather.h"
#include "kernels/cuda/selected_rows.h"
#include "kvstore/cuda_host_memory.h"
#include "kvstore/store.h"
#include "tests/gpu/bench_util.h"

ABSL_FLAG(int, tokens, 32768, "Tokens per layer");
ABSL_FLAG(int, layers, 8, "Layers held (rotated through)");
ABSL_FLAG(std::string, densities, "0.01,0.05,0.1",
          "Fractions of tokens read per kv head (empty: none)");
ABSL_FLAG(int, reps, 20, "Timed calls per configuration (median)");
ABSL_FLAG(std::string, group_rows, "",
          "Distinct tokens a kv head for the group mixture's in-place read (comma list; empty: "
          "not run)");

namespace {

#define CK(x) KVSPARSE_BENCH_CK(x)

using kvsparse::bench::Median;

namespace kc = kvsparse::kernels::cuda;
namespace kv = kvsparse::kvstore;

constexpr int kHkv = 8, kH = 32, kD = 128;

// Device page lists of every (layer, kv head): tables[layer] is a device [kHkv] array of device
// arrays of page addresses (the store's mapped pages), as the engine's plans hold them.
struct PageTables {
  std::vector<const void* const* const*> tables;  // per layer
  int32_t page_shift = 0;
  std::vector<void*> allocations;
  ~PageTables() {
    for (void* p : allocations) cudaFree(p);
  }
};

bool BuildPageTables(const kv::PageView& view, int layers, int tokens, uint32_t page_tokens,
                     PageTables* out) {
  int shift = 0;
  while ((1u << shift) < page_tokens) ++shift;
  if ((1u << shift) != page_tokens) return false;
  out->page_shift = shift;
  const int pages = (tokens + static_cast<int>(page_tokens) - 1) / static_cast<int>(page_tokens);
  for (int l = 0; l < layers; ++l) {
    std::vector<const void*> heads(kHkv);
    for (int j = 0; j < kHkv; ++j) {
      std::vector<const void*> list(pages);
      for (int pg = 0; pg < pages; ++pg) {
        list[pg] = view.KRow(static_cast<uint32_t>(l), static_cast<uint32_t>(j),
                             static_cast<uint64_t>(pg) * page_tokens);
      }
      void* d = nullptr;
      CK(cudaMalloc(&d, pages * sizeof(void*)));
      CK(cudaMemcpy(d, list.data(), pages * sizeof(void*), cudaMemcpyHostToDevice));
      out->allocations.push_back(d);
      heads[j] = d;
    }
    void* d = nullptr;
    CK(cudaMalloc(&d, kHkv * sizeof(void*)));
    CK(cudaMemcpy(d, heads.data(), kHkv * sizeof(void*), cudaMemcpyHostToDevice));
    out->allocations.push_back(d);
    out->tables.push_back(static_cast<const void* const* const*>(d));
  }
  return true;
}

// Device buffers of the group reads, sized for the most rows a kv head.
struct GroupBuffers {
  void *q, *out, *pos, *cnt, *len, *ptrs, *gather;
  GroupBuffers(int max_rows, int tokens, size_t row) {
    CK(cudaMalloc(&q, kH * kD * 2));
    CK(cudaMalloc(&out, kH * kD * 2));
    CK(cudaMalloc(&pos, static_cast<size_t>(kH) * max_rows * 4));
    CK(cudaMalloc(&cnt, kH * 4));
    CK(cudaMalloc(&len, 4));
    CK(cudaMalloc(&ptrs, static_cast<size_t>(kHkv) * max_rows * sizeof(void*)));
    CK(cudaMalloc(&gather, static_cast<size_t>(kHkv) * max_rows * 2 * row));
    CK(cudaMemset(q, 0x3c, kH * kD * 2));  // every element 0x3c3c: a small finite bf16
    CK(cudaMemcpy(len, &tokens, 4, cudaMemcpyHostToDevice));
  }
  ~GroupBuffers() {
    for (void* d : {q, out, pos, cnt, len, ptrs, gather}) cudaFree(d);
  }
};

// `rows` distinct tokens a kv head, ascending, listed for every query head of its group (pos
// [kH, rows]); the slots of the same tokens in layer `other` (ptrs, kv head by kv head).
void PickRows(std::mt19937_64& rng, const kv::PageView& view, int tokens, int rows, int other,
              std::vector<int32_t>* pos, std::vector<const void*>* ptrs) {
  pos->assign(static_cast<size_t>(kH) * rows, 0);
  ptrs->clear();
  std::vector<int32_t> pick(tokens);
  for (int j = 0; j < kHkv; ++j) {
    for (int t = 0; t < tokens; ++t) pick[t] = t;
    for (int i = 0; i < rows; ++i) {
      std::swap(pick[i], pick[i + static_cast<int>(rng() % (tokens - i))]);
    }
    std::sort(pick.begin(), pick.begin() + rows);
    for (int g = 0; g < kH / kHkv; ++g) {
      std::copy(pick.begin(), pick.begin() + rows, pos->begin() + (j * (kH / kHkv) + g) * rows);
    }
    for (int i = 0; i < rows; ++i) {
      ptrs->push_back(view.KRow(static_cast<uint32_t>(other), static_cast<uint32_t>(j),
                                static_cast<uint64_t>(pick[i])));
    }
  }
}

// Every page of `layer` read once (WarmPagedRows), then the device idle.
void WarmLayer(const PageTables& pt, int layer, const GroupBuffers& b, int tokens, size_t row) {
  kc::WarmPagedRowsParams w;
  w.batch = 1;
  w.num_kv_heads = kHkv;
  w.pages = {pt.tables[layer], pt.page_shift, static_cast<int32_t>(2 * row), 0};
  w.seq_lens = static_cast<const int32_t*>(b.len);
  w.max_seq_len = tokens;
  CK(kc::WarmPagedRows(w, nullptr));
  CK(cudaDeviceSynchronize());
}

// ms of fn's kernels alone (CUDA events).
template <typename Fn>
float TimeOnce(Fn fn) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  fn();
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms;
}

// The group mixture's read of layer `layer`: the rows the buffers list, through the layer's page
// lists, as the engine's captured step reads them.
float TimeGroupRead(const PageTables& pt, int layer, const GroupBuffers& b, int tokens, int rows,
                    size_t row) {
  kc::SelectedRowsParams p;
  p.shape.batch = 1;
  p.shape.num_q_heads = kH;
  p.shape.num_kv_heads = kHkv;
  p.shape.head_dim = kD;
  p.shape.q = b.q;
  p.shape.out = b.out;
  p.shape.k_pages = {pt.tables[layer], pt.page_shift, static_cast<int32_t>(2 * row), 0};
  p.shape.v_pages = {pt.tables[layer], pt.page_shift, static_cast<int32_t>(2 * row),
                     static_cast<int32_t>(row)};
  p.shape.seq_lens = static_cast<const int32_t*>(b.len);
  p.shape.max_seq_len = tokens;
  p.shape.scale = 0.088f;
  p.positions = static_cast<const int32_t*>(b.pos);
  p.counts = static_cast<const int32_t*>(b.cnt);
  p.max_selected = rows;
  p.in_place = true;
  p.shared_rows = true;
  const size_t ws_bytes = kc::SelectedRowsWorkspaceBytes(p);
  void* ws = nullptr;
  if (ws_bytes > 0) CK(cudaMalloc(&ws, ws_bytes));
  const float ms = TimeOnce([&] { CK(kc::SelectedRowsDecode(p, ws, ws_bytes, nullptr)); });
  if (ws != nullptr) cudaFree(ws);
  return ms;
}

// The gather kernel over the slots the buffers list.
float TimeGather(const GroupBuffers& b, size_t num_rows, size_t row) {
  kc::GatherRowPtrsParams gp;
  gp.rows = static_cast<const void* const*>(b.ptrs);
  gp.num_rows = static_cast<int32_t>(num_rows);
  gp.row_bytes = static_cast<int32_t>(2 * row);
  gp.dst = b.gather;
  gp.dst_row_stride = gp.row_bytes;
  return TimeOnce([&] { CK(kc::GatherRowPtrs(gp, nullptr)); });
}

// The group mixture's read (SelectedRowsDecode, in place, shared rows) of each --group_rows
// count of distinct tokens a kv head, cold and warm, beside GatherRowPtrs over the same tokens'
// slots of another layer (cold or warmed alike); one line each, medians of `reps` calls.
int RunGroupReads(const kv::PageView& view, int layers, int tokens, uint32_t page_tokens,
                  int reps) {
  PageTables pt;
  if (!BuildPageTables(view, layers, tokens, page_tokens, &pt)) return 3;
  const size_t row = view.row_bytes();
  std::vector<int> counts_list;
  for (absl::string_view r : absl::StrSplit(absl::GetFlag(FLAGS_group_rows), ',')) {
    int c = 0;
    if (!absl::SimpleAtoi(r, &c) || c < 1 || c > tokens) return 2;
    counts_list.push_back(c);
  }
  GroupBuffers b(*std::max_element(counts_list.begin(), counts_list.end()), tokens, row);
  std::mt19937_64 rng(11);
  std::printf("\n%-10s %-5s %9s %9s %13s %11s %13s\n", "rows/head", "pages", "MB", "read us",
              "read GB/s", "gather us", "gather GB/s");
  std::vector<int32_t> pos;
  std::vector<const void*> ptrs;
  for (const int rows : counts_list) {
    for (const bool warm : {false, true}) {
      std::vector<float> read_ms, gather_ms;
      for (int rep = -2; rep < reps; ++rep) {
        const int layer = (rep + 2) % layers, other = (layer + layers / 2) % layers;
        PickRows(rng, view, tokens, rows, other, &pos, &ptrs);
        const std::vector<int32_t> cnt(kH, rows);
        CK(cudaMemcpy(b.pos, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(b.cnt, cnt.data(), kH * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(b.ptrs, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice));
        if (warm) WarmLayer(pt, layer, b, tokens, row);
        const float r = TimeGroupRead(pt, layer, b, tokens, rows, row);
        if (warm) WarmLayer(pt, other, b, tokens, row);
        const float g = TimeGather(b, ptrs.size(), row);
        if (rep >= 0) {
          read_ms.push_back(r);
          gather_ms.push_back(g);
        }
      }
      const double mb = static_cast<double>(kHkv) * rows * 2 * row / 1e6;
      const float r = Median(read_ms), g = Median(gather_ms);
      std::printf("%-10d %-5s %9.2f %9.1f %13.1f %11.1f %13.1f\n", rows, warm ? "warm" : "cold", mb,
                  r * 1e3, mb / r, g * 1e3, mb / g);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  namespace kv = kvsparse::kvstore;
  const int tokens = absl::GetFlag(FLAGS_tokens), layers = absl::GetFlag(FLAGS_layers);
  const int reps = absl::GetFlag(FLAGS_reps);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  auto memory = kv::NewPinnedHostMemoryResource();
  if (!memory.ok()) {
    std::fprintf(stderr, "%s\n", memory.status().ToString().c_str());
    return 1;
  }
  const kv::ModelShape shape{static_cast<uint32_t>(layers), 32, 8, 128,
                             kvsparse::kernels::DType::kBf16};
  const size_t row = shape.row_bytes();
  const uint64_t bytes = 2ull * layers * tokens * 8 * row;
  kv::StoreOptions so;
  so.capacity_bytes = bytes + (64 << 20);
  so.max_append_bytes = 1ull << 31;
  so.memory = memory->get();
  auto store = kv::Store::Create(so);
  if (!store.ok() || !(*store)->CreateSequence("s", shape, {}).ok()) return 1;
  std::fprintf(stderr, "%s: filling %.2f GB of pinned store pages...\n", prop.name, bytes / 1e9);
  {
    const uint64_t chunk = 1024;
    std::vector<uint8_t> block(layers * chunk * 8 * row);
    std::mt19937_64 rng(1);
    // Random values the store accepts.
    for (size_t i = 0; i < block.size(); ++i) {
      block[i] = kvsparse::kernels::AcceptedByte(static_cast<uint8_t>(rng()), i);
    }
    for (uint64_t t = 0; t < static_cast<uint64_t>(tokens); t += chunk) {
      kv::AppendRequest r;
      r.sequence_id = "s";
      r.num_layers = layers;
      r.num_tokens = std::min<uint64_t>(chunk, tokens - t);
      r.dtype = shape.dtype;
      r.num_kv_heads = 8;
      r.head_dim = 128;
      r.k = absl::MakeConstSpan(block.data(), layers * r.num_tokens * 8 * row);
      r.v = r.k;
      if (!(*store)->Append(r).ok()) return 1;
    }
  }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // Baseline: one bulk copy of 256 MiB from pinned host memory.
  const double h2d_gbs = kvsparse::bench::BulkHostToDeviceGBs();
  std::printf("device %s; bulk host-to-device copy (pinned, 256 MiB): %.1f GB/s\n", prop.name,
              h2d_gbs);
  std::printf("%-8s %-4s %9s %9s %11s %11s %9s %9s\n", "density", "kind", "rows", "MB", "list us",
              "kernel us", "GB/s", "% of H2D");
  auto view = (*store)->View("s");
  if (!view.ok()) return 1;
  const size_t max_rows = static_cast<size_t>(tokens) * 8;
  const void** d_ptrs = nullptr;
  void* d_out = nullptr;
  CK(cudaMalloc(reinterpret_cast<void**>(&d_ptrs), max_rows * sizeof(void*)));
  CK(cudaMalloc(&d_out, max_rows * 2 * row));
  std::mt19937_64 rng(7);
  std::vector<const void*> ptrs;
  for (absl::string_view ds :
       absl::StrSplit(absl::GetFlag(FLAGS_densities), ',', absl::SkipEmpty())) {
    double density = 0;
    if (!absl::SimpleAtod(ds, &density) || density <= 0 || density > 1) return 2;
    for (const bool kv_rows : {true, false}) {
      std::vector<float> kernel_ms;
      double list_us = 0;
      size_t rows = 0;
      for (int rep = -2; rep < reps; ++rep) {
        const uint32_t layer = static_cast<uint32_t>((rep + 2) % layers);
        const auto t0 = std::chrono::steady_clock::now();
        ptrs.clear();
        std::bernoulli_distribution pick(density);
        for (uint32_t j = 0; j < 8; ++j) {
          for (int t = 0; t < tokens; ++t) {
            if (!pick(rng)) continue;
            const uint8_t* slot = (*view)->KRow(layer, j, t);
            ptrs.push_back(kv_rows ? slot : slot + row);
          }
        }
        const auto t1 = std::chrono::steady_clock::now();
        CK(cudaMemcpy(d_ptrs, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice));
        kvsparse::kernels::cuda::GatherRowPtrsParams p;
        p.rows = d_ptrs;
        p.num_rows = static_cast<int32_t>(ptrs.size());
        p.row_bytes = static_cast<int32_t>(kv_rows ? 2 * row : row);
        p.dst = d_out;
        p.dst_row_stride = p.row_bytes;
        CK(cudaEventRecord(e0));
        CK(kvsparse::kernels::cuda::GatherRowPtrs(p, nullptr));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (rep >= 0) {
          kernel_ms.push_back(ms);
          list_us += std::chrono::duration<double, std::micro>(t1 - t0).count();
          rows = ptrs.size();
        }
      }
      const float ms = Median(kernel_ms);
      const double mb = rows * (kv_rows ? 2.0 : 1.0) * row / 1e6;
      std::printf("%-8.3f %-4s %9zu %9.2f %11.0f %11.1f %9.1f %8.0f%%\n", density,
                  kv_rows ? "kv" : "v", rows, mb, list_us / reps, ms * 1e3, mb / ms,
                  100.0 * (mb / ms) / h2d_gbs);
    }
  }
  if (absl::GetFlag(FLAGS_group_rows).empty()) return 0;
  absl::StatusOr<kv::SequenceInfo> info = (*store)->GetSequenceInfo("s");
  if (!info.ok()) return 1;
  return RunGroupReads(**view, layers, tokens, info->page_tokens, reps);
}
