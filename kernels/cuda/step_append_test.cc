// StepAppend: the step's token lands in the store's pages (pinned, mapped host memory) and the
// resident rows, the lengths and seeds follow the positions, and a position outside the
// sequence's window writes nothing and raises the error word; captured in a CUDA graph, replays
// follow the positions written before each replay, and the counters it is given are zeroed.
#include "kernels/cuda/step_append.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_util.h"
#include "kernels/cuda/gather.h"
#include "kernels/philox.h"

namespace kvsparse::kernels::cuda {
namespace {

constexpr int B = 2, Hkv = 2, kRow = 128, kPageTokens = 8, kPages = 4;
constexpr int kSlot = 2 * kRow;
constexpr int kWords = 2;
constexpr int64_t kMaxTokens = kPageTokens * kPages;

struct Fixture {
  // Host pages: B * Hkv lanes of kPages pages of kPageTokens slots, allocated as one mapped
  // block per lane and listed per page (the store's addressing).
  void* host = nullptr;
  std::vector<const void*> page_list;  // [B * Hkv][kPages]
  DeviceBuffer pages, lanes, k_rows, v_rows, k_heads, v_heads;
  DeviceBuffer positions, floor, top, error, lens, seeds, new_k, new_v;
  DeviceBuffer sigs, sig_heads, new_sigs;  // kWords words per key
  std::vector<uint8_t> nk, nv;
  std::vector<uint32_t> ns;

  void Init() {
    const size_t lane_bytes = static_cast<size_t>(kPages) * kPageTokens * kSlot;
    ASSERT_EQ(cudaHostAlloc(&host, B * Hkv * lane_bytes, cudaHostAllocMapped), cudaSuccess);
    std::memset(host, 0, B * Hkv * lane_bytes);
    for (int i = 0; i < B * Hkv; ++i) {
      for (int p = 0; p < kPages; ++p) {
        const void* dev = nullptr;
        ASSERT_EQ(MappedDevicePointer(static_cast<char*>(host) + i * lane_bytes +
                                          static_cast<size_t>(p) * kPageTokens * kSlot,
                                      &dev),
                  cudaSuccess);
        page_list.push_back(dev);
      }
    }
    pages = ToDevice(page_list);
    std::vector<const void*> lane_ptrs;
    for (int i = 0; i < B * Hkv; ++i) {
      lane_ptrs.push_back(pages.as<const void*>() + i * kPages);
    }
    lanes = ToDevice(lane_ptrs);
    k_rows = DeviceBuffer(static_cast<size_t>(B) * Hkv * kMaxTokens * kRow);
    v_rows = DeviceBuffer(k_rows.size());
    ASSERT_EQ(k_rows.Poison(0), cudaSuccess);
    ASSERT_EQ(v_rows.Poison(0), cudaSuccess);
    std::vector<void*> kh, vh;
    for (int i = 0; i < B * Hkv; ++i) {
      kh.push_back(k_rows.as<char>() + static_cast<size_t>(i) * kMaxTokens * kRow);
      vh.push_back(v_rows.as<char>() + static_cast<size_t>(i) * kMaxTokens * kRow);
    }
    k_heads = ToDevice(kh);
    v_heads = ToDevice(vh);
    sigs = DeviceBuffer(sizeof(uint32_t) * B * Hkv * kMaxTokens * kWords);
    ASSERT_EQ(sigs.Poison(0), cudaSuccess);
    std::vector<uint32_t*> sh;
    for (int i = 0; i < B * Hkv; ++i) sh.push_back(sigs.as<uint32_t>() + i * kMaxTokens * kWords);
    sig_heads = ToDevice(sh);
    new_sigs = DeviceBuffer(sizeof(uint32_t) * B * Hkv * kWords);
    floor = ToDevice(std::vector<int64_t>{3, 10});
    top = ToDevice(std::vector<int64_t>{3, 10});
    error = ToDevice(std::vector<int32_t>{0});
    lens = DeviceBuffer(B * sizeof(int32_t));
    seeds = DeviceBuffer(B * sizeof(uint64_t));
    positions = DeviceBuffer(B * sizeof(int64_t));
    new_k = DeviceBuffer(static_cast<size_t>(B) * Hkv * kRow);
    new_v = DeviceBuffer(new_k.size());
  }
  ~Fixture() {
    if (host != nullptr) cudaFreeHost(host);
  }
  StepAppendParams Params() const {
    StepAppendParams p;
    p.batch = B;
    p.num_kv_heads = Hkv;
    p.row_bytes = kRow;
    p.positions = positions.as<int64_t>();
    p.new_k = new_k.get();
    p.new_v = new_v.get();
    p.k_heads = k_heads.as<void*>();
    p.v_heads = v_heads.as<void*>();
    p.pages.tables = lanes.as<const void* const*>();
    p.pages.page_shift = 3;
    p.pages.slot_bytes = kSlot;
    p.new_sigs = new_sigs.as<uint32_t>();
    p.sig_heads = sig_heads.as<uint32_t*>();
    p.sig_words = kWords;
    p.floor = floor.as<int64_t>();
    p.top = top.as<int64_t>();
    p.max_tokens = kMaxTokens;
    p.error = error.as<int32_t>();
    p.seq_lens = lens.as<int32_t>();
    p.seeds = seeds.as<uint64_t>();
    p.seed = 77;
    return p;
  }
  // New rows for a step, distinct per step.
  void NewRows(int step) {
    std::mt19937 rng(step);
    nk.resize(new_k.size());
    nv.resize(new_v.size());
    for (auto& x : nk) x = static_cast<uint8_t>(rng());
    for (auto& x : nv) x = static_cast<uint8_t>(rng());
    ASSERT_EQ(new_k.Upload(nk.data(), nk.size()), cudaSuccess);
    ASSERT_EQ(new_v.Upload(nv.data(), nv.size()), cudaSuccess);
    ns.resize(static_cast<size_t>(B) * Hkv * kWords);
    for (auto& x : ns) x = static_cast<uint32_t>(rng());
    ASSERT_EQ(new_sigs.Upload(ns.data(), ns.size() * sizeof(uint32_t)), cudaSuccess);
  }
  const uint8_t* Slot(int i, int64_t t) const {
    const size_t lane_bytes = static_cast<size_t>(kPages) * kPageTokens * kSlot;
    return static_cast<const uint8_t*>(host) + i * lane_bytes + t * kSlot;
  }
  // The rows of step `step` at position pos[b] everywhere they belong.
  void ExpectWritten(const int64_t pos[B]) {
    std::vector<uint8_t> kd = ToHost<uint8_t>(k_rows, k_rows.size());
    std::vector<uint8_t> vd = ToHost<uint8_t>(v_rows, v_rows.size());
    std::vector<uint32_t> sd = ToHost<uint32_t>(sigs, sigs.size() / sizeof(uint32_t));
    for (int b = 0; b < B; ++b) {
      for (int j = 0; j < Hkv; ++j) {
        const int i = b * Hkv + j;
        const uint8_t* ek = nk.data() + i * kRow;
        const uint8_t* ev = nv.data() + i * kRow;
        EXPECT_EQ(std::memcmp(Slot(i, pos[b]), ek, kRow), 0) << "page K " << b << " " << j;
        EXPECT_EQ(std::memcmp(Slot(i, pos[b]) + kRow, ev, kRow), 0) << "page V " << b << " " << j;
        const size_t at = (static_cast<size_t>(i) * kMaxTokens + pos[b]) * kRow;
        EXPECT_EQ(std::memcmp(kd.data() + at, ek, kRow), 0) << "device K " << b << " " << j;
        EXPECT_EQ(std::memcmp(vd.data() + at, ev, kRow), 0) << "device V " << b << " " << j;
        for (int w = 0; w < kWords; ++w) {
          EXPECT_EQ(sd[(static_cast<size_t>(i) * kMaxTokens + pos[b]) * kWords + w],
                    ns[static_cast<size_t>(i) * kWords + w])
              << "signature " << b << " " << j;
        }
      }
    }
  }
};

TEST(StepAppendTest, WritesTheTokenWhereItBelongsAndRefusesOutsideTheWindow) {
  KVSPARSE_REQUIRE_GPU();
  Fixture f;
  f.Init();
  // Capture one step and replay it over several positions, as a CUDA graph would run it.
  cudaStream_t stream;
  KVSPARSE_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  DeviceBuffer progress(sizeof(int32_t)), zero(sizeof(int32_t) * 300);
  ASSERT_EQ(progress.Poison(), cudaSuccess);
  StepAppendParams params = f.Params();
  params.progress = progress.as<int32_t>();
  params.layer = 9;
  params.zero = zero.as<int32_t>();  // the caller's counters, zeroed by every step
  params.zero_words = 300;
  KVSPARSE_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  KVSPARSE_ASSERT_CUDA(StepAppend(params, stream));
  KVSPARSE_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  KVSPARSE_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int step = 0; step < 12; ++step) {
    const int64_t pos[B] = {3 + step, 10 + step};  // crosses page boundaries
    ASSERT_EQ(f.positions.Upload(pos, sizeof(pos)), cudaSuccess);
    f.NewRows(step);
    ASSERT_EQ(zero.Poison(), cudaSuccess);
    KVSPARSE_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    KVSPARSE_ASSERT_CUDA(cudaStreamSynchronize(stream));
    f.ExpectWritten(pos);
    const std::vector<int32_t> lens = ToHost<int32_t>(f.lens, B);
    const std::vector<uint64_t> seeds = ToHost<uint64_t>(f.seeds, B);
    const std::vector<int64_t> top = ToHost<int64_t>(f.top, B);
    for (int b = 0; b < B; ++b) {
      EXPECT_EQ(lens[b], pos[b] + 1);
      EXPECT_EQ(top[b], pos[b] + 1);
      EXPECT_EQ(seeds[b], SequenceSeed(77 + pos[b], b));
    }
    EXPECT_EQ(ToHost<int32_t>(f.error, 1)[0], 0);
    EXPECT_EQ(ToHost<int32_t>(progress, 1)[0], 9);  // the step's layer, for a side stream
    EXPECT_EQ(ToHost<int32_t>(zero, 300), std::vector<int32_t>(300, 0));
  }
  // Below the floor (committed rows), a row written already, a hole past the top, past the
  // reservation: nothing written, length 0, error raised; the other sequence goes on.
  const std::vector<uint8_t> before(f.Slot(0, 2), f.Slot(0, 2) + kSlot);
  const std::vector<uint8_t> written(f.Slot(0, 14), f.Slot(0, 14) + kSlot);
  int64_t next = 22;
  for (const int64_t bad : {int64_t{2}, int64_t{14}, int64_t{17}, kMaxTokens}) {
    const int64_t pos[B] = {bad, next++};
    ASSERT_EQ(f.positions.Upload(pos, sizeof(pos)), cudaSuccess);
    ASSERT_EQ(f.error.Poison(0), cudaSuccess);
    f.NewRows(200);
    KVSPARSE_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    KVSPARSE_ASSERT_CUDA(cudaStreamSynchronize(stream));
    EXPECT_EQ(ToHost<int32_t>(f.error, 1)[0], 1) << bad;
    const std::vector<int32_t> lens = ToHost<int32_t>(f.lens, B);
    EXPECT_EQ(lens[0], 0) << bad;
    EXPECT_EQ(lens[1], next) << bad;
    EXPECT_EQ(ToHost<int64_t>(f.top, B)[0], 15) << bad;
  }
  EXPECT_EQ(std::memcmp(before.data(), f.Slot(0, 2), kSlot), 0);
  EXPECT_EQ(std::memcmp(written.data(), f.Slot(0, 14), kSlot), 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
