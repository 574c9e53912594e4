// Kernel-only sweep of the CUDA paged decode attention's variants (issue 34): for each (context,
// batch) cell in the Llama-3.1-8B attention shape (bf16, 32 query heads, 8 KV heads, head_dim 128,
// block size 16, blocks shuffled across the pool as after real decoding) and each variant (split
// merge kernel or folded, CTAs per SM 1/2/4/8, load depth 1/2), it times paged_decode_attention
// alone over 32 back-to-back "layers": replayed from a CUDA graph (as the engine runs decode) and
// launched eagerly. It reports us per layer, GB/s of KV read and the fraction of a device-to-device
// copy's bandwidth measured in the same run, as a markdown table on stdout and JSON (--json).
//
//   bench_paged_decode_cuda [--out PATH.md] [--json PATH] [--contexts 1024,8192,32768]
//                           [--batches 1,8,64] [--repeats 5] [--budget-s 55] [--mem-fraction 0.6]
//
// --out and --json are rewritten after every cell, so a run stopped early leaves what it measured.
// --budget-s counts from the process start: cells that would not finish in it are skipped.
//
// Needs a CUDA device (exits 2 with a message without one). Sized for well under a minute on an H100.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cache_manager/paged_attention_cuda.h"
#include "common/check.h"

namespace {

using kvserve::cuda::DecodeTuning;

// The Llama-3.1-8B attention shape of the acceptance rows.
constexpr int64_t kHeads = 32, kKvHeads = 8, kHeadDim = 128, kBlockSize = 16;
constexpr int64_t kLayers = 32;  // launches per timed run: one decode step's attention layers
constexpr int64_t kBlockBytes = 2 * kKvHeads * kBlockSize * kHeadDim * 2;  // K and V of one block, bf16

// Command-line settings.
struct Options {
  std::string out;  // markdown report
  std::string json;
  std::vector<int64_t> contexts{1024, 8192, 32768};
  std::vector<int64_t> batches{1, 8, 64};
  int repeats = 5;
  double budget_s = 55.0;
  double mem_fraction = 0.6;  // of the free memory the pools may take
};

std::vector<int64_t> parse_list(const std::string& flag, const std::string& v) {
  std::vector<int64_t> out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long long x = std::strtoll(item.c_str(), &end, 10);
    KV_CHECK(!item.empty() && *end == '\0' && x > 0,
             flag << ": expected positive integers separated by commas, got '" << v << "'");
    out.push_back(x);
  }
  KV_CHECK(!out.empty(), flag << ": empty list");
  return out;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      KV_CHECK(i + 1 < argc, a << " needs a value");
      return argv[++i];
    };
    if (a == "--json") {
      o.json = value();
    } else if (a == "--out") {
      o.out = value();
    } else if (a == "--contexts") {
      o.contexts = parse_list(a, value());
    } else if (a == "--batches") {
      o.batches = parse_list(a, value());
    } else if (a == "--repeats") {
      o.repeats = std::max(1, std::atoi(value().c_str()));
    } else if (a == "--budget-s") {
      o.budget_s = std::atof(value().c_str());
    } else if (a == "--mem-fraction") {
      o.mem_fraction = std::atof(value().c_str());
      KV_CHECK(o.mem_fraction > 0 && o.mem_fraction <= 0.95, "--mem-fraction must be in (0, 0.95]");
    } else if (a == "-h" || a == "--help") {
      std::cout
          << "usage: bench_paged_decode_cuda [--out PATH.md] [--json PATH] [--contexts 1024,8192,32768]\n"
             "                               [--batches 1,8,64] [--repeats 5] [--budget-s 55] [--mem-fraction 0.6]\n";
      std::exit(0);
    } else {
      KV_FAIL("unknown argument '" << a << "' (--help lists them)");
    }
  }
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Device-to-device copy bandwidth, counted as bytes read + written, like bench/bench_gpu.py's probe.
double copy_bandwidth_gbs(const torch::Device& dev) {
  const int64_t bytes = int64_t{2} << 30;
  torch::Tensor src = torch::ones({bytes / 2}, torch::TensorOptions().dtype(torch::kBFloat16).device(dev));
  torch::Tensor dst = torch::empty_like(src);
  for (int i = 0; i < 3; ++i) dst.copy_(src);
  const at::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
  std::vector<double> ts;
  for (int i = 0; i < 9; ++i) {
    at::cuda::CUDAEvent a(cudaEventDefault), b(cudaEventDefault);
    a.record(stream);
    dst.copy_(src);
    b.record(stream);
    b.synchronize();
    ts.push_back(a.elapsed_time(b) / 1e3);
  }
  return 2.0 * static_cast<double>(bytes) / median(ts) / 1e9;
}

std::vector<DecodeTuning> variants() {
  std::vector<DecodeTuning> out;
  for (bool fold : {false, true}) {
    for (int ctas : {1, 2, 4, 8}) {
      for (int loads : {1, 2}) out.push_back(DecodeTuning{ctas, loads, fold});
    }
  }
  return out;
}

bool is_default(const DecodeTuning& t) {
  const DecodeTuning d;
  return t.ctas_per_sm == d.ctas_per_sm && t.loads == d.loads && t.fold_merge == d.fold_merge;
}

std::string label(const DecodeTuning& t) {
  return std::string(t.fold_merge ? "fold" : "kernel") + " c" + std::to_string(t.ctas_per_sm) + " l" +
         std::to_string(t.loads);
}

// One variant's timings in one cell.
struct Result {
  DecodeTuning tuning;
  int num_splits = 1;
  double graph_us = 0, eager_us = 0;  // medians, per layer
  std::vector<double> graph_runs_us;  // every repeat, per layer
  double max_diff = -1;               // layer 0's output against the default variant's (-1: not compared)
  std::string error;                  // set when the variant failed
};

// One (context, batch) cell.
struct Cell {
  int64_t context = 0, batch = 0;
  int64_t distinct_layers = 0;  // pool slices cycled through by the 32 launches
  double kv_bytes = 0;          // KV bytes one launch reads
  std::vector<Result> results;
  std::string skipped;
};

// The cell's pool, per-layer tables (blocks shuffled over the whole pool) and inputs.
struct Setup {
  torch::Tensor pool, q, rows, lengths;
  std::vector<torch::Tensor> tables;
  int64_t max_blocks = 0;
};

Setup make_setup(int64_t context, int64_t batch, int64_t layers, const torch::Device& dev, uint64_t seed) {
  Setup s;
  s.max_blocks = (context + kBlockSize - 1) / kBlockSize;
  const int64_t per_layer = batch * s.max_blocks;
  const int64_t n = per_layer * layers;
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(dev);
  s.pool = torch::empty({n, 2, kKvHeads, kBlockSize, kHeadDim}, bf16);
  s.pool.normal_(0.0, 1.0);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor t = torch::from_blob(ids.data() + l * per_layer, {batch, s.max_blocks}, torch::kInt32);
    s.tables.push_back(t.to(dev));
  }
  s.q = torch::randn({batch, kHeads, kHeadDim}, bf16);
  s.rows = torch::arange(batch, torch::TensorOptions().dtype(torch::kInt32).device(dev));
  s.lengths = torch::full({batch}, context, torch::TensorOptions().dtype(torch::kInt32).device(dev));
  return s;
}

torch::Tensor attend(const Setup& s, int64_t layer) {
  return kvserve::cuda::paged_decode_attention(s.q, s.pool, s.tables[static_cast<size_t>(layer) % s.tables.size()],
                                               s.rows, s.lengths, s.max_blocks);
}

// Times one variant: eager launches, then the same 32 launches captured once and replayed.
Result run_variant(const Setup& s, const DecodeTuning& t, const torch::Tensor& reference, int repeats, int sms) {
  Result r;
  r.tuning = t;
  r.num_splits =
      kvserve::cuda::decode_split_plan(s.q.size(0), kHeads, kKvHeads, s.max_blocks, sms, t.ctas_per_sm).num_splits;
  kvserve::cuda::set_decode_tuning(t);
  const at::cuda::CUDAStream main = at::cuda::getCurrentCUDAStream();
  const torch::Tensor first = attend(s, 0);  // grows the split counters before any capture
  r.max_diff = (first.to(torch::kFloat32) - reference.to(torch::kFloat32)).abs().max().item<double>();
  for (int64_t l = 0; l < kLayers; ++l) attend(s, l);  // warm-up
  std::vector<double> eager;
  for (int i = 0; i < std::max(2, repeats / 2); ++i) {
    at::cuda::CUDAEvent a(cudaEventDefault), b(cudaEventDefault);
    a.record(main);
    for (int64_t l = 0; l < kLayers; ++l) attend(s, l);
    b.record(main);
    b.synchronize();
    eager.push_back(a.elapsed_time(b) * 1e3 / kLayers);
  }
  r.eager_us = median(eager);

  at::cuda::CUDAGraph graph;
  {
    const at::cuda::CUDAStream side = at::cuda::getStreamFromPool();
    side.synchronize();
    main.synchronize();
    const c10::cuda::CUDAStreamGuard guard(side);
    graph.capture_begin();
    try {
      for (int64_t l = 0; l < kLayers; ++l) attend(s, l);
    } catch (...) {
      // End the broken capture so that the stream (and the next variant) stays usable.
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      if (cudaStreamIsCapturing(side.stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
        cudaGraph_t raw = nullptr;
        if (cudaStreamEndCapture(side.stream(), &raw) == cudaSuccess && raw != nullptr) cudaGraphDestroy(raw);
      }
      throw;
    }
    graph.capture_end();
  }
  graph.replay();  // warm
  for (int i = 0; i < repeats; ++i) {
    at::cuda::CUDAEvent a(cudaEventDefault), b(cudaEventDefault);
    a.record(main);
    graph.replay();
    b.record(main);
    b.synchronize();
    r.graph_runs_us.push_back(a.elapsed_time(b) * 1e3 / kLayers);
  }
  r.graph_us = median(r.graph_runs_us);
  return r;
}

std::string fixed(double v, int digits) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v;
  return os.str();
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o;
}

// The cells in the order they run: the acceptance cells first, the most expensive last, so
// that a short budget still measures what matters.
std::vector<std::pair<int64_t, int64_t>> cell_order(const Options& o) {
  std::vector<std::pair<int64_t, int64_t>> cells;
  for (int64_t c : o.contexts) {
    for (int64_t b : o.batches) cells.emplace_back(c, b);
  }
  auto rank = [](const std::pair<int64_t, int64_t>& x) {
    if (x.first == 32768 && x.second == 8) return -2.0;
    if (x.first == 1024 && x.second == 1) return -1.0;
    return static_cast<double>(x.first) * static_cast<double>(x.second);
  };
  std::stable_sort(cells.begin(), cells.end(), [&](const auto& a, const auto& b) { return rank(a) < rank(b); });
  return cells;
}

// An error message as one markdown table cell (conditions in KV_CHECK messages contain "||").
std::string table_text(const std::string& s) {
  std::string o;
  for (char c : s) o += c == '|' ? '/' : (c == '\n' ? ' ' : c);
  return o;
}

// What the whole run shares: the device and the copy bandwidth.
struct Env {
  std::string device;
  int sms = 0;
  double copy_gbs = 0;
};

// Largest difference from the default variant's bf16 output that still counts as the same answer
// (outputs are averages of N(0, 1) values; the gtests check every variant against fp64 properly).
constexpr double kMaxDiff = 1e-2;

double cell_gbs(const Cell& c, double us) { return us > 0 ? c.kv_bytes / (us * 1e-6) / 1e9 : 0.0; }

// The markdown report: per cell the default against the best variant, then every variant.
std::string markdown(const Env& env, const std::vector<Cell>& cells, double elapsed_s, bool done) {
  std::ostringstream os;
  const std::string& name = env.device;
  const int sms = env.sms;
  const double copy_gbs = env.copy_gbs;
  os << "# Paged decode attention sweep\n\n"
     << name << ", " << sms << " SMs; device-to-device copy " << fixed(copy_gbs, 0)
     << " GB/s (bytes read + written / time). Shape: bf16, " << kHeads << " query heads, " << kKvHeads
     << " KV heads, head_dim " << kHeadDim << ", block size " << kBlockSize
     << ", blocks shuffled. Times: median us per layer over " << kLayers
     << " back-to-back launches, replayed from a CUDA graph (eager in the last columns). "
        "\"% copy\" = KV bytes read / time against the copy bandwidth. Variant: merge (kernel | fold), "
        "CTAs per SM (c), load depth (l); the default is kernel c2 l1. \"best\" leaves out variants whose "
        "output differs from the default's by more than "
     << kMaxDiff << ".\n\n";
  os << "| context | batch | default us | best | best us | best vs default | best % copy |\n"
        "| ---: | ---: | ---: | --- | ---: | ---: | ---: |\n";
  for (const Cell& c : cells) {
    if (!c.skipped.empty()) {
      os << "| " << c.context << " | " << c.batch << " | skipped: " << c.skipped << " | | | | |\n";
      continue;
    }
    const Result* def = nullptr;
    const Result* best = nullptr;
    for (const Result& r : c.results) {
      if (!r.error.empty()) continue;
      if (is_default(r.tuning)) def = &r;
      if (r.max_diff > kMaxDiff) continue;  // fast but wrong is no candidate
      if (best == nullptr || r.graph_us < best->graph_us) best = &r;
    }
    if (def == nullptr || best == nullptr) {
      os << "| " << c.context << " | " << c.batch << " | failed | | | | |\n";
      continue;
    }
    os << "| " << c.context << " | " << c.batch << " | " << fixed(def->graph_us, 2) << " | " << label(best->tuning)
       << " | " << fixed(best->graph_us, 2) << " | " << fixed(def->graph_us / best->graph_us, 3) << "x | "
       << fixed(100.0 * cell_gbs(c, best->graph_us) / copy_gbs, 1) << " % |\n";
  }
  os << "\n| context | batch | variant | splits | us/layer | GB/s | % copy | vs default | eager us | eager % copy | "
        "max diff vs default |\n"
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
  for (const Cell& c : cells) {
    if (!c.skipped.empty()) continue;
    double def_us = 0;
    for (const Result& r : c.results) {
      if (r.error.empty() && is_default(r.tuning)) def_us = r.graph_us;
    }
    for (const Result& r : c.results) {
      os << "| " << c.context << " | " << c.batch << " | " << label(r.tuning) << " | ";
      if (!r.error.empty()) {
        os << "failed: " << table_text(r.error) << " | | | | | | | |\n";
        continue;
      }
      os << r.num_splits << " | " << fixed(r.graph_us, 2) << " | " << fixed(cell_gbs(c, r.graph_us), 0) << " | "
         << fixed(100.0 * cell_gbs(c, r.graph_us) / copy_gbs, 1) << " | "
         << (def_us > 0 ? fixed(def_us / r.graph_us, 3) + "x" : "") << " | " << fixed(r.eager_us, 2) << " | "
         << fixed(100.0 * cell_gbs(c, r.eager_us) / copy_gbs, 1) << " | " << fixed(r.max_diff, 4)
         << (r.max_diff > kMaxDiff ? " **WRONG**" : "") << " |\n";
    }
  }
  os << "\nTotal " << fixed(elapsed_s, 1) << " s" << (done ? "" : " so far (still running)") << ".\n";

  return os.str();
}

std::string json(const Env& env, const std::vector<Cell>& cells, double elapsed_s) {
  std::ostringstream js;
  const int sms = env.sms;
  const double copy_gbs = env.copy_gbs;
  js << "{\n  \"device\": \"" << json_escape(env.device) << "\", \"sms\": " << sms
     << ", \"copy_gbs\": " << fixed(copy_gbs, 1) << ",\n  \"shape\": {\"dtype\": \"bfloat16\", \"heads\": " << kHeads
     << ", \"kv_heads\": " << kKvHeads << ", \"head_dim\": " << kHeadDim << ", \"block_size\": " << kBlockSize
     << ", \"layers\": " << kLayers << "},\n  \"total_s\": " << fixed(elapsed_s, 2) << ",\n  \"cells\": [";
  for (size_t i = 0; i < cells.size(); ++i) {
    const Cell& c = cells[i];
    js << (i ? "," : "") << "\n    {\"context\": " << c.context << ", \"batch\": " << c.batch
       << ", \"kv_bytes_per_layer\": " << fixed(c.kv_bytes, 0) << ", \"distinct_layers\": " << c.distinct_layers;
    if (!c.skipped.empty()) js << ", \"skipped\": \"" << json_escape(c.skipped) << "\"";
    js << ", \"variants\": [";
    for (size_t j = 0; j < c.results.size(); ++j) {
      const Result& r = c.results[j];
      js << (j ? "," : "") << "\n      {\"merge\": \"" << (r.tuning.fold_merge ? "fold" : "kernel")
         << "\", \"ctas_per_sm\": " << r.tuning.ctas_per_sm << ", \"loads\": " << r.tuning.loads
         << ", \"default\": " << (is_default(r.tuning) ? "true" : "false");
      if (!r.error.empty()) {
        js << ", \"error\": \"" << json_escape(r.error) << "\"}";
        continue;
      }
      js << ", \"num_splits\": " << r.num_splits << ", \"graph_us\": " << fixed(r.graph_us, 3)
         << ", \"eager_us\": " << fixed(r.eager_us, 3) << ", \"gbs\": " << fixed(cell_gbs(c, r.graph_us), 1)
         << ", \"fraction_of_copy\": " << fixed(cell_gbs(c, r.graph_us) / copy_gbs, 4)
         << ", \"max_diff_vs_default\": " << fixed(r.max_diff, 6) << ", \"graph_runs_us\": [";
      for (size_t k = 0; k < r.graph_runs_us.size(); ++k) js << (k ? ", " : "") << fixed(r.graph_runs_us[k], 3);
      js << "]}";
    }
    js << "]}";
  }
  js << "\n  ]\n}\n";
  return js.str();
}

// Rewrites a report file whole (after every cell, so a run stopped early still leaves its tables).
void write_file(const std::string& path, const std::string& text) {
  if (path.empty()) return;
  std::ofstream f(path, std::ios::trunc);
  KV_CHECK(f.good(), "cannot write " << path);
  f << text;
}

int run(const Options& o, std::chrono::steady_clock::time_point t0) {
  if (!kvserve::cuda::compiled()) {
    std::cerr
        << "bench_paged_decode_cuda: this build has no CUDA kernels (KVSERVE_WITH_CUDA and nvcc at configure time)\n";
    return 2;
  }
  if (!torch::cuda::is_available()) {
    std::cerr << "bench_paged_decode_cuda: no CUDA device; this benchmark runs only on a GPU\n";
    return 2;
  }
  const torch::Device dev(torch::kCUDA, 0);
  const c10::cuda::CUDAGuard guard(dev);
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int sms = prop->multiProcessorCount;
  const DecodeTuning was = kvserve::cuda::decode_tuning();
  const double copy_gbs = copy_bandwidth_gbs(dev);
  const Env env{prop->name, sms, copy_gbs};
  c10::cuda::CUDACachingAllocator::emptyCache();
  std::cerr << prop->name << ": " << sms << " SMs, device copy " << fixed(copy_gbs, 0) << " GB/s (read + write)\n";

  std::vector<Cell> cells;
  for (const auto& [context, batch] : cell_order(o)) {
    Cell cell;
    cell.context = context;
    cell.batch = batch;
    const double layer_bytes = static_cast<double>(batch) *
                               static_cast<double>((context + kBlockSize - 1) / kBlockSize) *
                               static_cast<double>(kBlockBytes);
    cell.kv_bytes = static_cast<double>(batch) * static_cast<double>(context) * kBlockBytes / kBlockSize;
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    const double room = o.mem_fraction * static_cast<double>(free_b);
    // Enough distinct layer slices that the 32 launches cycle through ~10x the L2 (50 MB on an H100),
    // as a real step's layers do, and no more: filling the pool costs time too.
    const int64_t want = std::max<int64_t>(2, static_cast<int64_t>(std::ceil(512e6 / layer_bytes)));
    cell.distinct_layers = std::min<int64_t>({kLayers, want, static_cast<int64_t>(room / layer_bytes)});
    // Launches > 2 GB of KV (32K x 64) get fewer repeats; they are the least noisy and the slowest.
    const int repeats = cell.kv_bytes > 2e9 ? std::min(o.repeats, 3) : o.repeats;
    // Expected time: 16 variants x (warm-up + eager + replays) x 32 launches at 60 % of the copy
    // bandwidth (bytes read + written, about what the KV reads can reach).
    const double launches = 16.0 * kLayers * (2 + std::max(2, repeats / 2) + repeats);
    const double expect_s = launches * cell.kv_bytes / (0.6 * copy_gbs * 1e9);
    const double left = o.budget_s - seconds_since(t0);
    if (cell.distinct_layers < 1) {
      cell.skipped =
          "does not fit: " + fixed(layer_bytes / 1e9, 1) + " GB per layer, " + fixed(room / 1e9, 1) + " GB of room";
    } else if (expect_s + 2.0 > left) {
      cell.skipped = "over budget: ~" + fixed(expect_s, 0) + " s expected, " + fixed(std::max(0.0, left), 0) +
                     " s left of --budget-s";
    }
    if (!cell.skipped.empty()) {
      std::cerr << "cell " << context << " x " << batch << ": skipped (" << cell.skipped << ")\n";
      cells.push_back(std::move(cell));
      continue;
    }
    const auto tc = std::chrono::steady_clock::now();
    {
      const Setup setup = make_setup(context, batch, cell.distinct_layers, dev, 1234 + context + batch);
      kvserve::cuda::set_decode_tuning(DecodeTuning{});
      const torch::Tensor reference = attend(setup, 0);
      for (const DecodeTuning& t : variants()) {
        Result r;
        try {
          r = run_variant(setup, t, reference, repeats, sms);
        } catch (const std::exception& e) {
          r.tuning = t;
          r.error = e.what();
          std::cerr << "  " << label(t) << " failed: " << e.what() << "\n";
          (void)cudaGetLastError();
        }
        cell.results.push_back(std::move(r));
      }
      kvserve::cuda::set_decode_tuning(was);
    }
    c10::cuda::CUDACachingAllocator::emptyCache();
    std::cerr << "cell " << context << " x " << batch << ": " << fixed(seconds_since(tc), 1) << " s ("
              << cell.distinct_layers << " distinct layer slices)\n";
    cells.push_back(std::move(cell));
    write_file(o.out, markdown(env, cells, seconds_since(t0), false));
    write_file(o.json, json(env, cells, seconds_since(t0)));
  }
  kvserve::cuda::set_decode_tuning(was);

  const std::string md = markdown(env, cells, seconds_since(t0), true);
  write_file(o.out, md);
  write_file(o.json, json(env, cells, seconds_since(t0)));
  std::cout << md;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    return run(parse_args(argc, argv), t0);
  } catch (const std::exception& e) {
    std::cerr << "bench_paged_decode_cuda: " << e.what() << "\n";
    return 1;
  }
}
