#include "cache_manager/paged_kv_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_set>

#include "cache_manager/kernel_dtype.h"
#include "cache_manager/paged_attention.h"
#include "cache_manager/paged_attention_cuda.h"
#include "common/check.h"

namespace kvserve {

using torch::indexing::Slice;

namespace {
// The CUDA decode kernels serve a CUDA pool when this build has them; KVSERVE_PAGED_KERNEL=torch
// forces the libtorch gather path (a fallback while the kernels are new).
bool use_cuda_kernels(const KvBlockPool& pool) {
  static const bool forced_torch = [] {
    const char* e = std::getenv("KVSERVE_PAGED_KERNEL");
    return e != nullptr && std::string(e) == "torch";
  }();
  // A quantized pool's rows are read by the quantized kernel, whatever the compute dtype's width.
  return pool.device().is_cuda() && cuda::compiled() && !forced_torch && pool.head_dim() <= 256 &&
         is_cuda_kernel_dtype(pool.dtype());
}
// The pool's own geometry: one KV head per block in the head-wise layout.
KvPoolOptions block_options(KvPoolOptions o) {
  KV_CHECK(o.num_kv_heads >= 1, "KV pool needs at least one KV head, got " << o.num_kv_heads);
  if (o.head_blocks) o.num_kv_heads = 1;
  return o;
}
}  // namespace

PagedKvCache::PagedKvCache(int64_t num_layers, const KvPoolOptions& options, std::shared_ptr<KvSlabs> slabs)
    : num_layers_(num_layers),
      heads_(options.num_kv_heads),
      lanes_(options.head_blocks ? options.num_kv_heads : 1),
      head_split_(options.head_blocks),
      heads_per_block_(options.head_blocks ? 1 : options.num_kv_heads),
      slabs_(std::move(slabs)),
      pool_(slabs_ ? KvBlockPool(block_options(options), slabs_->storage()) : KvBlockPool(block_options(options))),
      alloc_(slabs_ ? BlockAllocator(slabs_, slabs_->slab_bytes() / pool_.block_bytes()) : BlockAllocator(pool_.num_blocks())),
      kv_(pool_.num_kv_heads()),
      bs_(options.block_size),
      d_(options.head_dim),
      dev_(num_layers, options.device),
      rotates_(pool_.quantized() && kv_quant_rotation_enabled()) {
  KV_CHECK(num_layers > 0, "PagedKvCache needs at least one layer, got " << num_layers);
  pos_.assign(static_cast<size_t>(pool_.num_blocks() * kv_ * bs_), 0);
  if (!slabs_) return;
  KV_CHECK(slabs_->slab_bytes() % pool_.block_bytes() == 0,
           "KV cache on a shared storage: its " << pool_.block_bytes() << "-byte blocks do not divide the "
                                                << slabs_->slab_bytes() << "-byte slabs (a format it was not sized for)");
  slabs_->set_reclaimer(alloc_.slab_client(), [this](int64_t n) { reclaim_slabs(n); });
}

PagedKvCache::~PagedKvCache() {
  if (slabs_) slabs_->set_reclaimer(alloc_.slab_client(), nullptr);
}

torch::Tensor PagedKvCache::encode(const torch::Tensor& x) const {
  if (pool_.quantized()) return kv_quant_encode(x, pool_.quant(), rotates_).to(pool_.device());
  return x.to(torch::TensorOptions().dtype(pool_.dtype()).device(pool_.device()));
}

torch::Tensor PagedKvCache::decode(const torch::Tensor& rows) const {
  if (!pool_.quantized()) return rows;
  return kv_quant_decode(rows, pool_.quant(), d_, pool_.dtype(), rotates_);
}

torch::Tensor PagedKvCache::stored_attention(const torch::Tensor& q, const torch::Tensor& table,
                                             const torch::Tensor& lengths, double scale, int64_t window) const {
  return paged_attention(q, pool_.storage(), table, lengths, scale, window, pool_.quant(), rotates_);
}

// ---------------------------------------------------------------------------------------------------
// sequences

void PagedKvCache::add_sequence(int64_t seq_id) {
  KV_CHECK(!seqs_.count(seq_id), "sequence " << seq_id << " already in the KV cache");
  KV_CHECK(lanes_ == 1 || (seq_id >= 0 && seq_id <= std::numeric_limits<int64_t>::max() / lanes_ - 1),
           "sequence id " << seq_id << " out of range for head-wise block tables");
  seqs_.emplace(seq_id, SequenceBlockTable(num_layers_ * lanes_));
  for (int64_t lane = 0; lane < lanes_; ++lane) dev_.add(row_key(seq_id, lane));
}

void PagedKvCache::release(int64_t seq_id) {
  SequenceBlockTable& t = table_of(seq_id);
  for (int64_t l = 0; l < t.num_layers(); ++l) {
    drop_blocks(t.layer(l).blocks);
    t.layer(l).length = 0;
  }
  seqs_.erase(seq_id);
  draft_blocks_.erase(seq_id);
  for (int64_t lane = 0; lane < lanes_; ++lane) dev_.remove(row_key(seq_id, lane));
  if (step_.active && std::find(step_.seq_ids.begin(), step_.seq_ids.end(), seq_id) != step_.seq_ids.end())
    step_.active = false;
}

std::vector<int64_t> PagedKvCache::sequence_ids() const {
  std::vector<int64_t> ids;
  ids.reserve(seqs_.size());
  for (const auto& [id, t] : seqs_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

SequenceBlockTable& PagedKvCache::table_of(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  KV_CHECK(it != seqs_.end(), "sequence " << seq_id << " not in the KV cache");
  return it->second;
}

const SequenceBlockTable& PagedKvCache::table_of(int64_t seq_id) const {
  return const_cast<PagedKvCache*>(this)->table_of(seq_id);
}

void PagedKvCache::rename_sequence(int64_t from, int64_t to) {
  KV_CHECK(!seqs_.count(to), "sequence " << to << " already in the KV cache");
  KV_CHECK(!step_.active || std::find(step_.seq_ids.begin(), step_.seq_ids.end(), from) == step_.seq_ids.end(),
           "rename: sequence " << from << " is in the planned decode step");
  auto node = seqs_.extract(from);
  KV_CHECK(!node.empty(), "sequence " << from << " not in the KV cache");
  node.key() = to;
  seqs_.insert(std::move(node));
  if (auto d = draft_blocks_.extract(from); !d.empty()) {
    d.key() = to;
    draft_blocks_.insert(std::move(d));
  }
  for (int64_t lane = 0; lane < lanes_; ++lane) dev_.rename(row_key(from, lane), row_key(to, lane));
}

void PagedKvCache::set_draft_blocks(int64_t seq_id, int64_t layer, int64_t lane, std::vector<int32_t> blocks) {
  (void)lane_of(seq_id, layer, lane);  // checks the sequence, layer and lane
  auto& per = draft_blocks_[seq_id];
  per.resize(static_cast<size_t>(num_layers_ * lanes_));
  per[static_cast<size_t>(slot(layer, lane))] = std::move(blocks);
}

const std::vector<int32_t>* PagedKvCache::draft_blocks(int64_t seq_id, int64_t layer, int64_t lane) const {
  auto it = draft_blocks_.find(seq_id);
  if (it == draft_blocks_.end()) return nullptr;
  const auto& b = it->second[static_cast<size_t>(slot(layer, lane))];
  return b.empty() ? nullptr : &b;
}

LayerBlocks& PagedKvCache::lane_of(int64_t seq_id, int64_t layer, int64_t lane) {
  KV_CHECK(layer >= 0 && layer < num_layers_, "layer " << layer << " out of range [0, " << num_layers_ << ")");
  KV_CHECK(lane >= 0 && lane < lanes_, "lane " << lane << " out of range [0, " << lanes_ << ")");
  return table_of(seq_id).layer(slot(layer, lane));
}

std::vector<int64_t> PagedKvCache::lane_lengths(const char* what, const std::vector<int64_t>& head_lengths,
                                                int64_t n) const {
  if (head_lengths.empty()) return std::vector<int64_t>(static_cast<size_t>(lanes_), n);
  KV_CHECK(static_cast<int64_t>(head_lengths.size()) == heads_,
           what << ": " << head_lengths.size() << " head lengths for " << heads_ << " KV heads");
  for (int64_t x : head_lengths) KV_CHECK(x >= 0 && x <= n, what << ": head length " << x << " outside [0, " << n << "]");
  if (lanes_ == 1) {
    KV_CHECK(std::all_of(head_lengths.begin(), head_lengths.end(), [n](int64_t x) { return x == n; }),
             what << ": KV heads keeping different numbers of tokens need the head-wise layout (head_blocks)");
    return {n};
  }
  return head_lengths;
}

bool PagedKvCache::reclaim(int64_t need) {
  if (reclaim_own(need) || !slabs_) return need <= alloc_.free_blocks();
  // Short on a shared storage: the other formats' caches give up cached blocks until enough of
  // their slabs empty (a slab returns only once none of its blocks is used).
  const int64_t per = alloc_.blocks_per_slab();
  const int64_t short_by = need - alloc_.free_blocks();
  slabs_->reclaim_for(alloc_.slab_client(), slabs_->free_slabs() + (short_by + per - 1) / per);
  return need <= alloc_.free_blocks();
}

std::vector<int32_t> PagedKvCache::request_blocks_per_slab() const {
  if (!slabs_) return {};
  std::vector<int32_t> used(static_cast<size_t>(slabs_->num_slabs()));
  for (size_t s = 0; s < used.size(); ++s) used[s] = alloc_.slab_used(static_cast<int64_t>(s));
  std::vector<int32_t> idle;
  if (prefix_) prefix_->idle_blocks(idle);
  if (contexts_) contexts_->idle_blocks(idle);
  const int64_t per = alloc_.blocks_per_slab();
  // A reclaim frees a block only where the cache holds its last reference.
  for (int32_t b : idle)
    if (alloc_.refcount(b) == 1) --used[static_cast<size_t>(b / per)];
  return used;
}

void PagedKvCache::reclaim_slabs(int64_t slabs) {
  while (slabs_->free_slabs() < slabs) {
    const int64_t used = alloc_.used_blocks();
    reclaim_own(alloc_.free_blocks() + 1);
    if (alloc_.used_blocks() == used) return;  // nothing cached is idle any more
  }
}

bool PagedKvCache::reclaim_own(int64_t need) {
  // Prefix-cache blocks go first: a compressed context stands for its whole compression pass.
  if (need > alloc_.free_blocks() && prefix_) prefix_->reclaim(need, alloc_);
  // Compressed contexts move to the host tier where it has room for them, else they are dropped.
  while (need > alloc_.free_blocks() && contexts_) {
    const int32_t e = contexts_->oldest_idle();
    if (e < 0) break;
    if (!context_to_host(e)) contexts_->drop(e, alloc_);
  }
  return need <= alloc_.free_blocks();
}

namespace {

// A compressed context's blocks in host-tier slots of `per` blocks each, the last padded with its
// first block (copied out and back onto itself).
std::vector<std::vector<int32_t>> tier_slot_groups(const std::vector<int32_t>& blocks, size_t per) {
  std::vector<std::vector<int32_t>> groups;
  for (size_t i = 0; i < blocks.size(); i += per) {
    groups.emplace_back(blocks.begin() + static_cast<std::ptrdiff_t>(i),
                        blocks.begin() + static_cast<std::ptrdiff_t>(std::min(i + per, blocks.size())));
    groups.back().resize(per, groups.back().front());
  }
  return groups;
}

}  // namespace

bool PagedKvCache::context_to_host(int32_t e) {
  if (!tier_) return false;
  std::vector<int32_t> blocks;
  for (const auto& t : contexts_->tables(e)) blocks.insert(blocks.end(), t.blocks.begin(), t.blocks.end());
  if (blocks.empty()) return false;
  // A slot holds one block per (layer, lane); an entry takes as many slots as its blocks fill.
  const auto per = static_cast<size_t>(num_layers_ * lanes_);
  const auto slots_needed = static_cast<int64_t>((blocks.size() + per - 1) / per);
  if (slots_needed > tier_->num_slots() || !contexts_->make_tier_room(slots_needed, alloc_)) return false;
  std::vector<int32_t> slots, positions;
  for (const auto& group : tier_slot_groups(blocks, per)) slots.push_back(tier_->store(group));
  // A kept entry's positions are wherever its policy kept them: they travel with it.
  for (int32_t b : blocks)
    for (int64_t h = 0; h < kv_; ++h) positions.insert(positions.end(), pos_ptr(b, h), pos_ptr(b, h) + bs_);
  contexts_->moved_to_host(e, std::move(slots), std::move(positions), alloc_);
  return true;
}

void PagedKvCache::context_to_pool(int32_t e) {
  KV_CHECK(contexts_ && contexts_->on_host(e) && contexts_->users(e) > 0,
           "internal: compressed context " << e << " is not a tier entry in use");
  int64_t n = 0;
  for (const auto& t : contexts_->tables(e)) n += blocks_for_tokens(t.length, bs_);
  // The entry is in use, so this allocation's reclaim never drops it from the tier.
  std::vector<int32_t> blocks = take_blocks(n, -1, -1);
  const auto per = static_cast<size_t>(num_layers_ * lanes_);
  const std::vector<int32_t>& slots = contexts_->host_slots(e);
  const std::vector<std::vector<int32_t>> groups = tier_slot_groups(blocks, per);
  for (size_t s = 0; s < groups.size(); ++s) tier_->load(slots.at(s), groups[s]);
  const std::vector<int32_t>& positions = contexts_->host_positions(e);
  KV_CHECK(positions.size() == blocks.size() * static_cast<size_t>(kv_ * bs_), "internal: compressed context " << e
                                                                                 << " positions do not fit its blocks");
  const int32_t* p = positions.data();
  for (int32_t b : blocks)
    for (int64_t h = 0; h < kv_; ++h, p += bs_) std::copy(p, p + bs_, pos_ptr(b, h));
  contexts_->moved_to_pool(e, blocks);
}

std::vector<int32_t> PagedKvCache::take_blocks(int64_t n, int64_t seq_id, int64_t layer) {
  reclaim(n);
  if (n > alloc_.free_blocks()) {
    KV_FAIL("KV pool exhausted: need " << n << " blocks, " << alloc_.free_blocks() << " free (sequence " << seq_id
                                       << ", layer " << layer << ")");
  }
  return alloc_.allocate(n);
}

void PagedKvCache::drop_blocks(std::vector<int32_t>& blocks) {
  for (int32_t b : blocks) alloc_.decref(b);
  blocks.clear();
}

std::pair<torch::Tensor, torch::Tensor> PagedKvCache::slot_index(const std::vector<int32_t>& blocks,
                                                                 int64_t count) const {
  torch::Tensor blk = torch::empty({count}, torch::kLong);
  torch::Tensor off = torch::empty({count}, torch::kLong);
  int64_t* bp = blk.data_ptr<int64_t>();
  int64_t* op = off.data_ptr<int64_t>();
  for (int64_t j = 0; j < count; ++j) {
    bp[j] = blocks[static_cast<size_t>(j / bs_)];
    op[j] = j % bs_;
  }
  const auto dev = pool_.device();
  return {blk.to(dev), off.to(dev)};
}

// ---------------------------------------------------------------------------------------------------
// content

void PagedKvCache::write(int64_t seq_id, int64_t layer, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& positions, const std::vector<int64_t>& head_lengths) {
  SequenceBlockTable& t = table_of(seq_id);
  KV_CHECK(layer >= 0 && layer < num_layers_, "write: layer " << layer << " out of range [0, " << num_layers_ << ")");
  KV_CHECK(k.dim() == 3 && k.size(0) == heads_ && k.size(2) == d_,
           "write: k must be [KV=" << heads_ << ", n, D=" << d_ << "], got " << k.sizes());
  KV_CHECK(v.sizes() == k.sizes(), "write: v " << v.sizes() << " != k " << k.sizes());
  const int64_t n = k.size(1);
  KV_CHECK(positions.dim() == 2 && positions.size(0) == heads_ && positions.size(1) == n,
           "write: positions must be [KV=" << heads_ << ", n=" << n << "], got " << positions.sizes());
  const std::vector<int64_t> lens = lane_lengths("write", head_lengths, n);
  const torch::Tensor pos = positions.to(torch::kCPU, torch::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t h = 0; h < heads_; ++h) {
    for (int64_t j = 0; j < lens[static_cast<size_t>(h / kv_)]; ++j) {
      KV_CHECK(pp[h * n + j] >= 0 && pp[h * n + j] <= std::numeric_limits<int32_t>::max(),
               "write: position " << pp[h * n + j] << " out of range");
    }
  }

  // The layer's own exclusively held blocks come back before the new ones are taken.
  int64_t need = 0, reclaimable = 0;
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    need += blocks_for_tokens(lens[static_cast<size_t>(lane)], bs_);
    for (int32_t b : t.layer(slot(layer, lane)).blocks) reclaimable += alloc_.refcount(b) == 1;
  }
  reclaim(need - reclaimable);
  if (need > alloc_.free_blocks() + reclaimable) {
    KV_FAIL("KV pool exhausted: need " << need - reclaimable << " blocks, " << alloc_.free_blocks() << " free (sequence "
                                       << seq_id << ", layer " << layer << ")");
  }
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    LayerBlocks& lb = t.layer(slot(layer, lane));
    drop_blocks(lb.blocks);
    lb.length = 0;
  }
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    LayerBlocks& lb = t.layer(slot(layer, lane));
    const int64_t m = lens[static_cast<size_t>(lane)];
    lb.blocks = take_blocks(blocks_for_tokens(m, bs_), seq_id, layer);
    if (m > 0) {
      const auto [blk, off] = slot_index(lb.blocks, m);
      pool_.keys().index_put_({blk, Slice(), off}, encode(lane_rows(k, lane).narrow(1, 0, m)).transpose(0, 1));
      pool_.values().index_put_({blk, Slice(), off}, encode(lane_rows(v, lane).narrow(1, 0, m)).transpose(0, 1));
    }
    for (int64_t h = 0; h < kv_; ++h) {
      const int64_t* hp = pp + (lane * kv_ + h) * n;
      for (int64_t j = 0; j < m; ++j) pos_ptr(lb.blocks[static_cast<size_t>(j / bs_)], h)[j % bs_] = static_cast<int32_t>(hp[j]);
    }
    lb.length = m;
    mirror_layer(seq_id, layer, lane, lb);
  }
}

void PagedKvCache::extend(int64_t seq_id, int64_t layer, const torch::Tensor& k, const torch::Tensor& v,
                          const torch::Tensor& positions) {
  SequenceBlockTable& t = table_of(seq_id);
  KV_CHECK(layer >= 0 && layer < num_layers_, "extend: layer " << layer << " out of range [0, " << num_layers_ << ")");
  KV_CHECK(k.dim() == 3 && k.size(0) == heads_ && k.size(2) == d_,
           "extend: k must be [KV=" << heads_ << ", n, D=" << d_ << "], got " << k.sizes());
  KV_CHECK(v.sizes() == k.sizes(), "extend: v " << v.sizes() << " != k " << k.sizes());
  const int64_t n = k.size(1);
  KV_CHECK(positions.dim() == 2 && positions.size(0) == heads_ && positions.size(1) == n,
           "extend: positions must be [KV=" << heads_ << ", n=" << n << "], got " << positions.sizes());
  const torch::Tensor pos = positions.to(torch::kCPU, torch::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < heads_ * n; ++i) {
    KV_CHECK(pp[i] >= 0 && pp[i] <= std::numeric_limits<int32_t>::max(), "extend: position " << pp[i] << " out of range");
  }
  if (n == 0) return;
  // Blocks are taken (or the exhaustion error thrown) before anything changes.
  std::vector<int64_t> more(static_cast<size_t>(lanes_));
  int64_t need = 0;
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    const LayerBlocks& lb = t.layer(slot(layer, lane));
    KV_CHECK(lb.length == lb.capacity(bs_) || alloc_.refcount(lb.blocks.back()) == 1,
             "extend: last block of sequence " << seq_id << " layer " << layer << " is shared");
    more[static_cast<size_t>(lane)] = blocks_for_tokens(lb.length + n, bs_) - static_cast<int64_t>(lb.blocks.size());
    need += std::max<int64_t>(0, more[static_cast<size_t>(lane)]);
  }
  std::vector<int32_t> fresh = need > 0 ? take_blocks(need, seq_id, layer) : std::vector<int32_t>{};
  size_t next = 0;
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    LayerBlocks& lb = t.layer(slot(layer, lane));
    const int64_t len = lb.length;
    for (int64_t i = 0; i < more[static_cast<size_t>(lane)]; ++i) lb.blocks.push_back(fresh[next++]);
    auto [blk, off] = slot_index(lb.blocks, len + n);
    blk = blk.narrow(0, len, n);
    off = off.narrow(0, len, n);
    pool_.keys().index_put_({blk, Slice(), off}, encode(lane_rows(k, lane)).transpose(0, 1));
    pool_.values().index_put_({blk, Slice(), off}, encode(lane_rows(v, lane)).transpose(0, 1));
    for (int64_t h = 0; h < kv_; ++h) {
      const int64_t* hp = pp + (lane * kv_ + h) * n;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t s = len + j;
        pos_ptr(lb.blocks[static_cast<size_t>(s / bs_)], h)[s % bs_] = static_cast<int32_t>(hp[j]);
      }
    }
    lb.length = len + n;
    mirror_layer(seq_id, layer, lane, lb);
  }
}

void PagedKvCache::enable_prefix_cache(uint64_t salt, PrefixCache::KeyFn key_fn, int64_t host_tier_bytes) {
  KV_CHECK(!prefix_, "prefix cache enabled twice");
  KV_CHECK(host_tier_bytes >= 0, "cache.prefix_cache_bytes must not be negative, got " << host_tier_bytes);
  // An entry holds one block per (layer, lane).
  prefix_.emplace(num_layers_ * lanes_, bs_, salt, std::move(key_fn));
  if (host_tier_bytes > 0) {
    tier_.emplace(pool_, num_layers_ * lanes_, host_tier_bytes);
    prefix_->attach_tier(&*tier_);
    if (contexts_) contexts_->attach_tier(&*tier_);
  }
}

size_t PagedKvCache::prefix_promote(const std::vector<int32_t>& entries) {
  KV_CHECK(prefix_, "prefix cache not enabled");
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!prefix_->on_host(entries[i])) continue;
    if (!prefix_->reclaim(num_layers_ * lanes_, alloc_)) return i;  // no room: the caller prefills the rest
    const std::vector<int32_t>& blocks = prefix_->promote(entries[i], alloc_);
    const int64_t first = int64_t{prefix_->depth(entries[i])} * bs_;
    for (int32_t b : blocks)
      for (int64_t h = 0; h < kv_; ++h)
        for (int64_t j = 0; j < bs_; ++j) pos_ptr(b, h)[j] = static_cast<int32_t>(first + j);
  }
  return entries.size();
}

void PagedKvCache::share(int64_t seq_id, int64_t layer, const std::vector<int32_t>& blocks, int64_t length) {
  KV_CHECK(blocks.size() % static_cast<size_t>(lanes_) == 0,
           "share: " << blocks.size() << " blocks do not split into " << lanes_ << " lanes");
  const size_t per_lane = blocks.size() / static_cast<size_t>(lanes_);
  KV_CHECK(length == static_cast<int64_t>(per_lane) * bs_,
           "share: " << per_lane << " blocks are shared whole, not as " << length << " slots");
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    const LayerBlocks& lb = lane_of(seq_id, layer, lane);
    KV_CHECK(lb.blocks.empty() && lb.length == 0, "share: sequence " << seq_id << " layer " << layer << " is not empty");
  }
  for (int32_t b : blocks) alloc_.incref(b);
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    LayerBlocks& lb = lane_of(seq_id, layer, lane);
    const auto first = blocks.begin() + static_cast<std::ptrdiff_t>(per_lane * static_cast<size_t>(lane));
    lb.blocks.assign(first, first + static_cast<std::ptrdiff_t>(per_lane));
    lb.length = length;
    mirror_layer(seq_id, layer, lane, lb);
  }
}

void PagedKvCache::drop_cached() {
  if (prefix_) prefix_->clear(alloc_);
  if (contexts_) contexts_->clear(alloc_);
}

void PagedKvCache::enable_context_cache() {
  KV_CHECK(!contexts_, "compressed context cache enabled twice");
  contexts_.emplace(num_layers_ * lanes_);
  if (tier_) contexts_->attach_tier(&*tier_);
}

void PagedKvCache::clone_block(int32_t src, int32_t dst) {
  pool_.keys().select(0, dst).copy_(pool_.keys().select(0, src));
  pool_.values().select(0, dst).copy_(pool_.values().select(0, src));
  for (int64_t h = 0; h < kv_; ++h) std::memcpy(pos_ptr(dst, h), pos_ptr(src, h), sizeof(int32_t) * static_cast<size_t>(bs_));
}

int64_t PagedKvCache::tail_copies(const std::vector<CompressedContextCache::Table>& tables) const {
  int64_t n = 0;
  for (const auto& t : tables) n += t.length % bs_ != 0;
  return n;
}

std::vector<CompressedContextCache::Table> PagedKvCache::share_tables(
    const std::vector<CompressedContextCache::Table>& from, int64_t seq_id) {
  // Whole blocks are shared; a partly filled last block is copied so that whoever appends to it
  // (the sequence after its context, another request's question) writes its own.
  std::vector<int32_t> fresh = take_blocks(tail_copies(from), seq_id, -1);
  std::vector<CompressedContextCache::Table> out(from.size());
  size_t next = 0;
  for (size_t i = 0; i < from.size(); ++i) {
    const auto& t = from[i];
    KV_CHECK(static_cast<int64_t>(t.blocks.size()) == blocks_for_tokens(t.length, bs_),
             "share: " << t.blocks.size() << " blocks for " << t.length << " slots");
    out[i].length = t.length;
    out[i].blocks = t.blocks;
    if (t.length % bs_ != 0) {
      const int32_t copy = fresh[next++];
      clone_block(t.blocks.back(), copy);
      out[i].blocks.back() = copy;
      for (size_t b = 0; b + 1 < t.blocks.size(); ++b) alloc_.incref(t.blocks[b]);
    } else {
      for (int32_t b : t.blocks) alloc_.incref(b);
    }
  }
  return out;
}

std::vector<CompressedContextCache::Table> PagedKvCache::snapshot(int64_t seq_id) {
  const SequenceBlockTable& t = table_of(seq_id);
  std::vector<CompressedContextCache::Table> tables(static_cast<size_t>(num_layers_ * lanes_));
  for (int64_t i = 0; i < num_layers_ * lanes_; ++i) {
    tables[static_cast<size_t>(i)].blocks = t.layer(i).blocks;
    tables[static_cast<size_t>(i)].length = t.layer(i).length;
  }
  return share_tables(tables, seq_id);
}

void PagedKvCache::adopt(int64_t seq_id, const std::vector<CompressedContextCache::Table>& tables) {
  KV_CHECK(static_cast<int64_t>(tables.size()) == num_layers_ * lanes_,
           "adopt: " << tables.size() << " block tables for " << num_layers_ << " layers x " << lanes_ << " lanes");
  SequenceBlockTable& t = table_of(seq_id);
  for (int64_t i = 0; i < num_layers_ * lanes_; ++i)
    KV_CHECK(t.layer(i).blocks.empty() && t.layer(i).length == 0, "adopt: sequence " << seq_id << " is not empty");
  auto own = share_tables(tables, seq_id);
  for (int64_t l = 0; l < num_layers_; ++l) {
    for (int64_t lane = 0; lane < lanes_; ++lane) {
      LayerBlocks& lb = t.layer(slot(l, lane));
      lb.blocks = std::move(own[static_cast<size_t>(slot(l, lane))].blocks);
      lb.length = own[static_cast<size_t>(slot(l, lane))].length;
      mirror_layer(seq_id, l, lane, lb);
    }
  }
}

std::vector<int32_t> PagedKvCache::store_blocks(const torch::Tensor& k, const torch::Tensor& v, int64_t first) {
  KV_CHECK(k.dim() == 3 && k.size(0) == heads_ && k.size(2) == d_ && v.sizes() == k.sizes(),
           "store_blocks: k, v must be [KV=" << heads_ << ", n, D=" << d_ << "], got " << k.sizes() << ", " << v.sizes());
  const int64_t n = k.size(1), per_lane = blocks_for_tokens(n, bs_);
  std::vector<int32_t> blocks = take_blocks(per_lane * lanes_, -1, -1);
  if (n == 0) return blocks;
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    const auto begin = blocks.begin() + lane * per_lane;
    const std::vector<int32_t> own(begin, begin + per_lane);
    const auto [blk, off] = slot_index(own, n);
    pool_.keys().index_put_({blk, Slice(), off}, encode(lane_rows(k, lane)).transpose(0, 1));
    pool_.values().index_put_({blk, Slice(), off}, encode(lane_rows(v, lane)).transpose(0, 1));
    for (int64_t h = 0; h < kv_; ++h)
      for (int64_t j = 0; j < n; ++j) pos_ptr(own[static_cast<size_t>(j / bs_)], h)[j % bs_] = static_cast<int32_t>(first + j);
  }
  return blocks;
}

int64_t PagedKvCache::private_blocks_of(int64_t seq_id) const {
  const SequenceBlockTable& t = table_of(seq_id);
  int64_t n = 0;
  for (int64_t l = 0; l < t.num_layers(); ++l)
    for (int32_t b : t.layer(l).blocks) n += alloc_.refcount(b) == 1;
  return n;
}

void PagedKvCache::mirror_layer(int64_t seq_id, int64_t layer, int64_t lane, const LayerBlocks& lb) {
  const int32_t row = dev_.row(row_key(seq_id, lane));
  dev_.set_blocks(row, layer, lb.blocks);
  dev_.set_length(row, layer, lb.length);
}

void PagedKvCache::drop_leading_blocks(int64_t seq_id, int64_t layer, int64_t n) {
  KV_CHECK(layer >= 0 && layer < num_layers_, "drop_leading_blocks: layer " << layer << " out of range [0, " << num_layers_
                                                                             << ")");
  if (n <= 0) return;
  KV_CHECK(!step_.active || std::find(step_.seq_ids.begin(), step_.seq_ids.end(), seq_id) == step_.seq_ids.end(),
           "drop_leading_blocks: sequence " << seq_id << " is in a planned decode step");
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    LayerBlocks& lb = lane_of(seq_id, layer, lane);
    KV_CHECK(n * bs_ <= lb.length, "drop_leading_blocks: " << n << " blocks of a lane holding " << lb.length << " slots");
    if (draft_blocks(seq_id, layer, lane)) set_draft_blocks(seq_id, layer, lane, {});
    std::vector<int32_t> gone(lb.blocks.begin(), lb.blocks.begin() + n);
    lb.blocks.erase(lb.blocks.begin(), lb.blocks.begin() + n);
    lb.length -= n * bs_;
    drop_blocks(gone);
    mirror_layer(seq_id, layer, lane, lb);
  }
}

void PagedKvCache::truncate_last(int64_t seq_id, int64_t n) {
  KV_CHECK(n >= 0, "truncate: " << n << " slots");
  if (n == 0) return;
  KV_CHECK(!step_.active || std::find(step_.seq_ids.begin(), step_.seq_ids.end(), seq_id) == step_.seq_ids.end(),
           "truncate: sequence " << seq_id << " is in a planned decode step");
  SequenceBlockTable& t = table_of(seq_id);
  for (int64_t l = 0; l < num_layers_; ++l)
    for (int64_t lane = 0; lane < lanes_; ++lane)
      KV_CHECK(n <= t.layer(slot(l, lane)).length, "truncate: " << n << " slots of sequence " << seq_id << " layer " << l
                                                                << ", which holds " << t.layer(slot(l, lane)).length);
  for (int64_t l = 0; l < num_layers_; ++l) {
    for (int64_t lane = 0; lane < lanes_; ++lane) {
      LayerBlocks& lb = t.layer(slot(l, lane));
      lb.length -= n;
      const auto keep = static_cast<size_t>(blocks_for_tokens(lb.length, bs_));
      if (lb.blocks.size() > keep) {
        std::vector<int32_t> gone(lb.blocks.begin() + static_cast<std::ptrdiff_t>(keep), lb.blocks.end());
        lb.blocks.resize(keep);
        drop_blocks(gone);
      }
      mirror_layer(seq_id, l, lane, lb);
    }
  }
}

void PagedKvCache::compact(int64_t seq_id, int64_t layer, const torch::Tensor& keep_slots,
                           const std::vector<int64_t>& head_counts) {
  SequenceBlockTable& t = table_of(seq_id);
  KV_CHECK(layer >= 0 && layer < num_layers_, "compact: layer " << layer << " out of range [0, " << num_layers_ << ")");
  KV_CHECK(keep_slots.dim() == 2 && keep_slots.size(0) == heads_,
           "compact: keep_slots must be [KV=" << heads_ << ", m], got " << keep_slots.sizes());
  const int64_t m = keep_slots.size(1);
  const std::vector<int64_t> counts = lane_lengths("compact", head_counts, m);
  for (int64_t lane = 0; lane < lanes_; ++lane)
    if (draft_blocks(seq_id, layer, lane)) set_draft_blocks(seq_id, layer, lane, {});
  const torch::Tensor keep = keep_slots.to(torch::kCPU, torch::kLong).contiguous();
  const int64_t* kp = keep.data_ptr<int64_t>();
  int64_t need = 0;
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    const LayerBlocks& lb = t.layer(slot(layer, lane));
    const int64_t c = counts[static_cast<size_t>(lane)];
    need += blocks_for_tokens(c, bs_);
    for (int64_t h = lane * kv_; h < (lane + 1) * kv_; ++h) {
      for (int64_t j = 0; j < c; ++j) {
        KV_CHECK(kp[h * m + j] >= 0 && kp[h * m + j] < lb.length,
                 "compact: slot " << kp[h * m + j] << " out of range [0, " << lb.length << ") (sequence " << seq_id
                                  << ", layer " << layer << ")");
      }
    }
  }
  std::vector<int32_t> all_fresh = take_blocks(need, seq_id, layer);
  size_t next = 0;
  const auto dev = pool_.device();
  const torch::Tensor head = torch::arange(kv_, torch::TensorOptions().dtype(torch::kLong).device(dev)).view({kv_, 1});
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    LayerBlocks& lb = t.layer(slot(layer, lane));
    const int64_t c = counts[static_cast<size_t>(lane)];
    const auto first = all_fresh.begin() + static_cast<std::ptrdiff_t>(next);
    std::vector<int32_t> fresh(first, first + blocks_for_tokens(c, bs_));
    next += fresh.size();
    if (c > 0) {
      torch::Tensor src_blk = torch::empty({kv_, c}, torch::kLong), src_off = torch::empty({kv_, c}, torch::kLong);
      int64_t* sb = src_blk.data_ptr<int64_t>();
      int64_t* so = src_off.data_ptr<int64_t>();
      for (int64_t h = 0; h < kv_; ++h) {
        const int64_t* hk = kp + (lane * kv_ + h) * m;
        for (int64_t j = 0; j < c; ++j) {
          sb[h * c + j] = lb.blocks[static_cast<size_t>(hk[j] / bs_)];
          so[h * c + j] = hk[j] % bs_;
        }
      }
      auto [dst_blk, dst_off] = slot_index(fresh, c);
      dst_blk = dst_blk.view({1, c});
      dst_off = dst_off.view({1, c});
      src_blk = src_blk.to(dev);
      src_off = src_off.to(dev);
      for (torch::Tensor half : {pool_.keys(), pool_.values()}) {
        const torch::Tensor kept = half.index({src_blk, head, src_off});  // [heads per lane, c, D], a copy
        half.index_put_({dst_blk, head, dst_off}, kept);
      }
      for (int64_t h = 0; h < kv_; ++h) {
        const int64_t* hk = kp + (lane * kv_ + h) * m;
        for (int64_t j = 0; j < c; ++j) {
          const int64_t s = hk[j];
          pos_ptr(fresh[static_cast<size_t>(j / bs_)], h)[j % bs_] =
              pos_ptr(lb.blocks[static_cast<size_t>(s / bs_)], h)[s % bs_];
        }
      }
    }
    drop_blocks(lb.blocks);
    lb.blocks = std::move(fresh);
    lb.length = c;
    mirror_layer(seq_id, layer, lane, lb);
  }
}

void PagedKvCache::append(int64_t layer, const std::vector<int64_t>& seq_ids, const torch::Tensor& k,
                          const torch::Tensor& v, const std::vector<int64_t>& positions) {
  const int64_t B = static_cast<int64_t>(seq_ids.size());
  KV_CHECK(k.dim() == 3 && k.size(0) == B && k.size(1) == heads_ && k.size(2) == d_,
           "append: k must be [B=" << B << ", KV=" << heads_ << ", D=" << d_ << "], got " << k.sizes());
  KV_CHECK(v.sizes() == k.sizes(), "append: v " << v.sizes() << " != k " << k.sizes());
  KV_CHECK(layer >= 0 && layer < num_layers_, "append: layer " << layer << " out of range [0, " << num_layers_ << ")");
  const Slots s = take_slots("append", seq_ids, positions, layer, 1);
  step_.active = false;  // the planned step's slots are stale now
  write_slots(s.block.data(), s.offset.data(), k.reshape({B * lanes_, kv_, d_}), v.reshape({B * lanes_, kv_, d_}));
}

PagedKvCache::Slots PagedKvCache::take_slots(const char* what, const std::vector<int64_t>& seq_ids,
                                             const std::vector<int64_t>& positions, int64_t first, int64_t layers) {
  const int64_t B = static_cast<int64_t>(seq_ids.size()), E = B * lanes_;
  KV_CHECK(static_cast<int64_t>(positions.size()) == B, what << ": " << positions.size() << " positions for " << B
                                                             << " sequences");
  Slots s;
  s.rows.resize(static_cast<size_t>(E));
  std::vector<SequenceBlockTable*> tables(static_cast<size_t>(B));
  std::unordered_set<int64_t> seen;
  s.grouped = false;
  for (int64_t b = 0; b < B; ++b) {
    // A sequence may take several consecutive entries (a speculative step's verified tokens) at
    // consecutive positions; it may not come back after another sequence.
    const bool again = b > 0 && seq_ids[b] == seq_ids[b - 1];
    KV_CHECK(again || seen.insert(seq_ids[b]).second, what << ": sequence " << seq_ids[b] << " twice in one batch");
    KV_CHECK(!again || positions[b] == positions[b - 1] + 1,
             what << ": sequence " << seq_ids[b] << "'s entries at positions " << positions[b - 1] << " and "
                  << positions[b] << " are not consecutive");
    s.grouped = s.grouped || again;
    KV_CHECK(positions[b] >= 0 && positions[b] <= std::numeric_limits<int32_t>::max(),
             what << ": position " << positions[b] << " out of range");
    tables[b] = &table_of(seq_ids[b]);
    for (int64_t lane = 0; lane < lanes_; ++lane) s.rows[b * lanes_ + lane] = dev_.row(row_key(seq_ids[b], lane));
  }
  // Every layer's blocks are taken before anything changes: a batch that cannot get them all fails whole.
  int64_t need = 0, first_seq = -1, first_layer = -1;
  for (int64_t l = first; l < first + layers; ++l) {
    for (int64_t b = 0, run = 0; b < B; ++b) {
      run = b > 0 && seq_ids[b] == seq_ids[b - 1] ? run + 1 : 0;  // the sequence's entries before this one
      for (int64_t lane = 0; lane < lanes_; ++lane) {
        const LayerBlocks& lb = tables[b]->layer(slot(l, lane));
        const int64_t at = lb.length + run;  // the slot this entry takes
        if (at % bs_ == 0 && at >= lb.capacity(bs_)) {
          if (need++ == 0) first_seq = seq_ids[b], first_layer = l;
        } else if (run == 0) {
          KV_CHECK(alloc_.refcount(lb.blocks.back()) == 1, what << ": last block of sequence " << seq_ids[b] << " layer "
                                                                << l << " is shared (copy-on-write not implemented)");
        }
      }
    }
  }
  reclaim(need);
  if (need > alloc_.free_blocks()) {
    KV_FAIL("KV pool exhausted: need " << need << " blocks, " << alloc_.free_blocks() << " free (sequence " << first_seq
                                       << ", layer " << first_layer << ")");
  }
  s.block.resize(static_cast<size_t>(layers * E));
  s.offset.resize(static_cast<size_t>(layers * E));
  if (s.grouped) s.lengths.resize(static_cast<size_t>(layers * E));
  s.max_blocks.assign(static_cast<size_t>(layers), 0);
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t l = first + i;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t lane = 0; lane < lanes_; ++lane) {
        const int64_t e = b * lanes_ + lane;
        LayerBlocks& lb = tables[b]->layer(slot(l, lane));
        if (lb.length == lb.capacity(bs_)) {
          lb.blocks.push_back(alloc_.allocate());
          dev_.set_block(s.rows[e], l, static_cast<int64_t>(lb.blocks.size()) - 1, lb.blocks.back());
        }
        const int32_t blk = lb.blocks.back();
        const int64_t off = lb.length % bs_;
        s.block[i * E + e] = blk;
        s.offset[i * E + e] = off;
        for (int64_t h = 0; h < kv_; ++h) pos_ptr(blk, h)[off] = static_cast<int32_t>(positions[b]);
        lb.length += 1;
        if (s.grouped) s.lengths[static_cast<size_t>(i * E + e)] = static_cast<int32_t>(lb.length);
        dev_.set_length(s.rows[e], l, lb.length);
        s.max_blocks[i] = std::max<int64_t>(s.max_blocks[i], static_cast<int64_t>(lb.blocks.size()));
      }
    }
  }
  return s;
}

void PagedKvCache::write_slots(const int32_t* blk, const int64_t* off, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t B = k.size(0);
  const bool fast = pool_.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu();
  if (fast && pool_.quantized()) {
    // Each row rotated (a copy) and encoded straight into its slot: no tensors on a decode step's path.
    const torch::Tensor kc = k.to(torch::kFloat32).contiguous(), vc = v.to(torch::kFloat32).contiguous();
    uint8_t* base = pool_.storage().data_ptr<uint8_t>();
    const int64_t row = pool_.row_elems(), tile = bs_ * row, block = 2 * kv_ * tile;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < kv_; ++h) {
        uint8_t* dst = base + blk[b] * block + h * tile + off[b] * row;
        for (int half = 0; half < 2; ++half) {
          const float* src = (half == 0 ? kc : vc).data_ptr<float>() + (b * kv_ + h) * d_;
          kv_quant_encode_row(pool_.quant(), src, d_, dst + half * kv_ * tile, rotates_);
        }
      }
    }
  } else if (fast) {
    // A 16-bit pool under fp32 activations: .to() rounds to nearest even, as every other write does;
    // a quantized pool gets its encoded rows.
    const torch::Tensor kc = encode(k).contiguous(), vc = encode(v).contiguous();
    const int64_t esz = static_cast<int64_t>(c10::elementSize(pool_.storage_dtype()));
    char* base = static_cast<char*>(pool_.storage().data_ptr());
    const char* ks = static_cast<const char*>(kc.data_ptr());
    const char* vs = static_cast<const char*>(vc.data_ptr());
    const int64_t row = pool_.row_elems() * esz, tile = bs_ * row, block = 2 * kv_ * tile;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < kv_; ++h) {
        char* dst = base + blk[b] * block + h * tile + off[b] * row;
        std::memcpy(dst, ks + (b * kv_ + h) * row, static_cast<size_t>(row));
        std::memcpy(dst + kv_ * tile, vs + (b * kv_ + h) * row, static_cast<size_t>(row));
      }
    }
  } else {
    const auto dev = pool_.device();
    const torch::Tensor bt = torch::tensor(std::vector<int64_t>(blk, blk + B), torch::kLong).to(dev);
    const torch::Tensor ot = torch::tensor(std::vector<int64_t>(off, off + B), torch::kLong).to(dev);
    pool_.keys().index_put_({bt, Slice(), ot}, encode(k));
    pool_.values().index_put_({bt, Slice(), ot}, encode(v));
  }
}

std::vector<int64_t> PagedKvCache::lane_keys(const std::vector<int64_t>& seq_ids) const {
  std::vector<int64_t> keys;
  keys.reserve(seq_ids.size() * static_cast<size_t>(lanes_));
  for (int64_t id : seq_ids) {
    table_of(id);  // unknown ids name the sequence
    for (int64_t lane = 0; lane < lanes_; ++lane) keys.push_back(row_key(id, lane));
  }
  return keys;
}

torch::Tensor PagedKvCache::batch_rows(const std::vector<int64_t>& seq_ids) {
  std::vector<int32_t> rows;
  for (int64_t key : lane_keys(seq_ids)) rows.push_back(dev_.row(key));
  return torch::tensor(rows, torch::kInt32).to(pool_.device());
}

int64_t PagedKvCache::max_blocks(int64_t layer, const std::vector<int64_t>& seq_ids) const {
  int64_t n = 0;
  for (int64_t id : seq_ids) {
    const SequenceBlockTable& t = table_of(id);
    for (int64_t lane = 0; lane < lanes_; ++lane)
      n = std::max<int64_t>(n, static_cast<int64_t>(t.layer(slot(layer, lane)).blocks.size()));
  }
  return n;
}

DecodeTables PagedKvCache::decode_tables(int64_t layer, const std::vector<int64_t>& seq_ids) {
  KV_CHECK(layer >= 0 && layer < num_layers_, "layer " << layer << " out of range [0, " << num_layers_ << ")");
  const torch::Tensor rows = batch_rows(seq_ids);
  dev_.flush();
  // Columns past the longest table are never read: keep the gather small.
  const int64_t cols = std::max<int64_t>(1, max_blocks(layer, seq_ids));
  return {dev_.tables(layer).index_select(0, rows).narrow(1, 0, cols), dev_.lengths(layer).index_select(0, rows)};
}

torch::Tensor PagedKvCache::attend(int64_t layer, const std::vector<int64_t>& seq_ids, const torch::Tensor& q,
                                   double scale) {
  const DecodeTables t = decode_tables(layer, seq_ids);
  const int64_t B = q.size(0), H = q.size(1);
  KV_CHECK(H % lanes_ == 0, "attend: " << H << " query heads for " << lanes_ << " KV heads");
  return stored_attention(q.reshape({B * lanes_, H / lanes_, q.size(2)}), t.block_table, t.lengths, scale, 0)
      .reshape({B, H, q.size(2)});
}

torch::Tensor PagedKvCache::append_and_attend(int64_t layer, const std::vector<int64_t>& seq_ids,
                                              const std::vector<int64_t>& positions, const torch::Tensor& q,
                                              const torch::Tensor& k, const torch::Tensor& v, double scale) {
  append(layer, seq_ids, k, v, positions);
  return attend(layer, seq_ids, q, scale);
}

void PagedKvCache::begin_decode(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& positions,
                                int64_t padded_rows, const DraftView& view) {
  step_.active = false;
  const int64_t B = static_cast<int64_t>(seq_ids.size());
  KV_CHECK(padded_rows <= 0 || padded_rows >= B,
           "decode: a batch of " << B << " sequences cannot be padded to " << padded_rows << " rows");
  const int64_t P = std::max(B, padded_rows);
  step_.slots = take_slots("decode", seq_ids, positions, 0, num_layers_);
  if (step_.slots.grouped && P > B) {
    for (int64_t b = B - 1; b >= 0; --b) truncate_last(seq_ids[b], 1);  // give the slots back
    KV_FAIL("decode: a speculative step (a sequence in several entries) cannot be padded to " << padded_rows << " rows");
  }
  // One kernel row per (sequence, lane), each at its sequence's position.
  std::vector<int32_t> rows = step_.slots.rows;
  std::vector<int64_t> pos;
  pos.reserve(static_cast<size_t>(P * lanes_));
  for (int64_t p : positions) pos.insert(pos.end(), static_cast<size_t>(lanes_), p);
  if (P > B) {
    rows.resize(static_cast<size_t>(P * lanes_), dev_.null_row());
    pos.resize(static_cast<size_t>(P * lanes_), 0);
  }
  dev_.set_batch(rows, pos);
  dev_.flush();
  step_.rows = dev_.batch_rows(P * lanes_);
  step_.seq_ids = seq_ids;
  step_.padded_rows = static_cast<size_t>(P);
  step_.split_hint = -1;
  step_.view = view;
  step_.done.assign(static_cast<size_t>(num_layers_), 0);
  step_.active = true;
}

bool PagedKvCache::decode_planned(const std::vector<int64_t>& seq_ids, int64_t layer, const DraftView& view) const {
  return step_.active && layer >= 0 && layer < num_layers_ && !step_.done[static_cast<size_t>(layer)] &&
         step_.seq_ids == seq_ids && step_.view == view;
}

int64_t PagedKvCache::planned_max_blocks() const {
  KV_CHECK(step_.active, "decode: no step is planned");
  int64_t n = 0;
  for (int64_t m : step_.slots.max_blocks) n = std::max(n, m);
  return n;
}

void PagedKvCache::fix_split_hint(int64_t hint) {
  KV_CHECK(step_.active, "decode: no step is planned");
  KV_CHECK(hint >= 0, "decode: split hint must be >= 0, got " << hint);
  step_.split_hint = hint;
}

void PagedKvCache::rearm_decode() {
  KV_CHECK(!step_.seq_ids.empty() && step_.padded_rows > 0, "decode: no step was planned");
  step_.done.assign(static_cast<size_t>(num_layers_), 0);
  step_.active = true;
}

bool PagedKvCache::device_kernels() const { return use_cuda_kernels(pool_); }

void PagedKvCache::reserve_decode_rows(int64_t rows) {
  // The null row and the sequences' rows share the capacity.
  dev_.reserve(rows * lanes_ + 1, dev_.block_capacity());
}

torch::Tensor PagedKvCache::decode_layer(int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, double scale, int64_t window) {
  KV_CHECK(step_.active && layer >= 0 && layer < num_layers_ && !step_.done[static_cast<size_t>(layer)],
           "decode: layer " << layer << " was not planned by begin_decode (or already ran)");
  const int64_t B = static_cast<int64_t>(step_.seq_ids.size()), P = static_cast<int64_t>(step_.padded_rows);
  KV_CHECK(k.dim() == 3 && k.size(0) == P && k.size(1) == heads_ && k.size(2) == d_,
           "decode: k must be [B=" << P << ", KV=" << heads_ << ", D=" << d_ << "], got " << k.sizes());
  KV_CHECK(v.sizes() == k.sizes(), "decode: v " << v.sizes() << " != k " << k.sizes());
  KV_CHECK(q.dim() == 3 && q.size(0) == P && q.size(1) % lanes_ == 0,
           "decode: q must have " << P << " rows of a multiple of " << lanes_ << " heads, got " << q.sizes());
  // Head-wise, each (sequence, lane) is one kernel row with its lane's query heads: [P * lanes, H / lanes, D].
  const int64_t E = B * lanes_, EP = P * lanes_, H = q.size(1);
  const torch::Tensor qr = lanes_ == 1 ? q : q.reshape({EP, H / lanes_, q.size(2)});
  const torch::Tensor kr = lanes_ == 1 ? k : k.reshape({EP, kv_, d_});
  const torch::Tensor vr = lanes_ == 1 ? v : v.reshape({EP, kv_, d_});
  auto unlane = [&](const torch::Tensor& out) { return lanes_ == 1 ? out : out.reshape({P, H, out.size(2)}); };
  const int64_t max_blocks = step_.slots.max_blocks[static_cast<size_t>(layer)];
  step_.done[static_cast<size_t>(layer)] = 1;
  if (std::all_of(step_.done.begin(), step_.done.end(), [](char d) { return d != 0; })) step_.active = false;
  const bool viewed = step_.view.active() && window == 0;  // a sliding-window layer already reads a window
  if (use_cuda_kernels(pool_) && !step_.slots.grouped && !viewed) {
    // Both read the step's tables, rows and lengths in place on the device: nothing built on the host.
    // Padding entries read the null row: length 0, so no slot is written and the output row is zero.
    const auto opts = torch::TensorOptions().dtype(pool_.dtype());
    cuda::paged_append(pool_.storage(), dev_.tables(layer), step_.rows, dev_.lengths(layer), kr.to(opts), vr.to(opts),
                       pool_.quant(), rotates_);
    return unlane(cuda::paged_decode_attention(qr, pool_.storage(), dev_.tables(layer), step_.rows, dev_.lengths(layer),
                                               step_.split_hint >= 0 ? step_.split_hint : max_blocks, scale, window,
                                               pool_.quant(), rotates_));
  }
  // A self-speculative draft step's tables: each entry's blocks and length cut from the host's
  // bookkeeping (which already counts this step's slot) to its view. Entry e is sequence e / lanes'
  // lane e % lanes (a draft step has one entry per sequence and lane and is never padded).
  auto view_tables = [&] {
    KV_CHECK(P == B && !step_.slots.grouped, "internal: a draft step of " << B << " sequences padded to " << P
                                                                          << " rows, or with several rows a sequence");
    const int64_t cols = std::max<int64_t>(1, max_blocks);
    torch::Tensor table = torch::zeros({E, cols}, torch::kInt32), lens = torch::empty({E}, torch::kInt32);
    int32_t* tp = table.data_ptr<int32_t>();
    int32_t* lp = lens.data_ptr<int32_t>();
    std::vector<const std::vector<int32_t>*> chosen;
    if (!draft_blocks_.empty()) chosen.resize(static_cast<size_t>(E), nullptr);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t seq = step_.seq_ids[static_cast<size_t>(e / lanes_)];
      const LayerBlocks& lb = lane_of(seq, layer, e % lanes_);
      std::copy_n(lb.blocks.begin(), std::min<int64_t>(cols, static_cast<int64_t>(lb.blocks.size())), tp + e * cols);
      lp[e] = static_cast<int32_t>(lb.length);
      if (!chosen.empty()) chosen[static_cast<size_t>(e)] = draft_blocks(seq, layer, e % lanes_);
    }
    return draft_view_tables(table, lens, bs_, step_.view, chosen);
  };
  const auto dev = pool_.device();
  if (viewed && use_cuda_kernels(pool_)) {
    // On the device kernels: the append as a plain step's, then the view's tables in one pinned,
    // asynchronous copy (the host goes on to the next layer) and the same attention kernel.
    const auto opts = torch::TensorOptions().dtype(pool_.dtype());
    cuda::paged_append(pool_.storage(), dev_.tables(layer), step_.rows, dev_.lengths(layer), kr.to(opts), vr.to(opts),
                       pool_.quant(), rotates_);
    auto [vt, vl] = view_tables();
    const torch::Tensor rows = torch::arange(E, torch::TensorOptions().dtype(torch::kInt32).device(dev));
    auto up = [&](const torch::Tensor& t) { return t.pin_memory().to(dev, torch::kInt32, /*non_blocking=*/true); };
    return unlane(cuda::paged_decode_attention(qr, pool_.storage(), up(vt), rows, up(vl), vt.size(1), scale, window,
                                               pool_.quant(), rotates_));
  }
  const int64_t* off = step_.slots.offset.data() + layer * E;
  write_slots(step_.slots.block.data() + layer * E, off, kr.narrow(0, 0, E), vr.narrow(0, 0, E));
  if (viewed) {
    auto [vt, vl] = view_tables();
    return unlane(stored_attention(qr, vt.to(dev), vl.to(dev), scale, window));
  }
  const int64_t cols = std::max<int64_t>(1, max_blocks);
  // A speculative step's entries of one sequence share its table row; each sees the slots up to its
  // own (causal within the run), so each carries its own length (such a step is never padded).
  const torch::Tensor grouped_lens =
      step_.slots.grouped
          ? torch::from_blob(const_cast<int32_t*>(step_.slots.lengths.data()) + layer * E, {E}, torch::kInt32)
          : torch::Tensor();
  if (dev.is_cpu()) {
    // The step's rows copied straight out of the host tables: two index_selects and their views
    // cost ~7 µs a layer, more than the attention over a short context at batch 1.
    const int64_t n = step_.rows.numel();
    const int32_t* rows = step_.rows.data_ptr<int32_t>();
    const int32_t* tables = dev_.host_tables(layer);
    const int32_t* lengths = dev_.host_lengths(layer);
    torch::Tensor table = torch::empty({n, cols}, torch::kInt32);
    int32_t* tp = table.data_ptr<int32_t>();
    for (int64_t e = 0; e < n; ++e)
      std::memcpy(tp + e * cols, tables + static_cast<int64_t>(rows[e]) * dev_.block_capacity(),
                  static_cast<size_t>(cols) * sizeof(int32_t));
    torch::Tensor lens = grouped_lens;
    if (!lens.defined()) {
      lens = torch::empty({n}, torch::kInt32);
      int32_t* lp = lens.data_ptr<int32_t>();
      for (int64_t e = 0; e < n; ++e) lp[e] = lengths[rows[e]];
    }
    return unlane(stored_attention(qr, table, lens, scale, window));
  }
  const torch::Tensor table = dev_.tables(layer).index_select(0, step_.rows).narrow(1, 0, cols);
  const torch::Tensor lens = grouped_lens.defined() ? grouped_lens.to(dev) : dev_.lengths(layer).index_select(0, step_.rows);
  return unlane(stored_attention(qr, table, lens, scale, window));
}

// ---------------------------------------------------------------------------------------------------
// inspection and accounting

const LayerBlocks& PagedKvCache::layer_blocks(int64_t seq_id, int64_t layer, int64_t lane) const {
  return const_cast<PagedKvCache*>(this)->lane_of(seq_id, layer, lane);
}

int64_t PagedKvCache::length(int64_t seq_id, int64_t layer) const {
  int64_t n = 0;
  for (int64_t lane = 0; lane < lanes_; ++lane) n = std::max(n, layer_blocks(seq_id, layer, lane).length);
  return n;
}

std::vector<int64_t> PagedKvCache::head_lengths(int64_t seq_id, int64_t layer) const {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(heads_));
  for (int64_t lane = 0; lane < lanes_; ++lane) out.insert(out.end(), static_cast<size_t>(kv_), layer_blocks(seq_id, layer, lane).length);
  return out;
}

bool PagedKvCache::uniform(int64_t seq_id, int64_t layer) const {
  const int64_t first = layer_blocks(seq_id, layer, 0).length;
  for (int64_t lane = 1; lane < lanes_; ++lane)
    if (layer_blocks(seq_id, layer, lane).length != first) return false;
  return true;
}

torch::Tensor PagedKvCache::positions(int64_t seq_id, int64_t layer) const {
  const int64_t n = length(seq_id, layer);
  torch::Tensor out = torch::full({heads_, n}, -1, torch::kLong);
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    const LayerBlocks& lb = layer_blocks(seq_id, layer, lane);
    for (int64_t h = 0; h < kv_; ++h) {
      int64_t* row = op + (lane * kv_ + h) * n;
      for (int64_t j = 0; j < lb.length; ++j) row[j] = pos_ptr(lb.blocks[static_cast<size_t>(j / bs_)], h)[j % bs_];
    }
  }
  return out;
}

std::pair<torch::Tensor, torch::Tensor> PagedKvCache::gather(int64_t seq_id, int64_t layer) const {
  KV_CHECK(uniform(seq_id, layer), "gather: the KV heads of sequence " << seq_id << " layer " << layer
                                                                       << " hold different numbers of tokens");
  std::vector<torch::Tensor> ks, vs;
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    const LayerBlocks& lb = layer_blocks(seq_id, layer, lane);
    const auto [blk, off] = slot_index(lb.blocks, lb.length);
    ks.push_back(decode(pool_.keys().index({blk, Slice(), off})).transpose(0, 1));
    vs.push_back(decode(pool_.values().index({blk, Slice(), off})).transpose(0, 1));
  }
  if (lanes_ == 1) return {ks[0].contiguous(), vs[0].contiguous()};
  return {torch::cat(ks, 0), torch::cat(vs, 0)};
}

std::tuple<torch::Tensor, torch::Tensor, std::vector<int64_t>> PagedKvCache::gather_padded(int64_t seq_id,
                                                                                         int64_t layer) const {
  if (uniform(seq_id, layer)) {
    auto [k, v] = gather(seq_id, layer);
    return {k, v, {}};
  }
  const int64_t n = length(seq_id, layer);
  std::vector<torch::Tensor> ks, vs;
  for (int64_t lane = 0; lane < lanes_; ++lane) {
    const LayerBlocks& lb = layer_blocks(seq_id, layer, lane);
    const auto [blk, off] = slot_index(lb.blocks, lb.length);
    auto k = decode(pool_.keys().index({blk, Slice(), off})).transpose(0, 1);  // [kv_, length, D]
    auto v = decode(pool_.values().index({blk, Slice(), off})).transpose(0, 1);
    const int64_t pad = n - lb.length;
    if (pad > 0) {
      k = torch::cat({k, torch::zeros({kv_, pad, d_}, k.options())}, 1);
      v = torch::cat({v, torch::zeros({kv_, pad, d_}, v.options())}, 1);
    }
    ks.push_back(k);
    vs.push_back(v);
  }
  return {torch::cat(ks, 0), torch::cat(vs, 0), head_lengths(seq_id, layer)};
}

int64_t PagedKvCache::blocks_of(int64_t seq_id) const { return table_of(seq_id).num_blocks(); }

int64_t PagedKvCache::blocks_needed(const std::vector<int64_t>& tokens_per_layer) const {
  int64_t n = 0;
  for (int64_t t : tokens_per_layer) {
    KV_CHECK(t >= 0, "blocks_needed: negative token count " << t);
    n += blocks_for_tokens(t, bs_) * lanes_;
  }
  return n;
}

int64_t PagedKvCache::blocks_for_next_token(int64_t seq_id) const {
  const SequenceBlockTable& t = table_of(seq_id);
  int64_t n = 0;
  for (int64_t l = 0; l < t.num_layers(); ++l) n += t.layer(l).length == t.layer(l).capacity(bs_);
  return n;
}

void PagedKvCache::check_invariants() const {
  alloc_.check_invariants();
  std::vector<int32_t> refs(static_cast<size_t>(alloc_.total_blocks()), 0);
  for (const auto& [id, t] : seqs_) {
    for (int64_t l = 0; l < t.num_layers(); ++l) {
      const LayerBlocks& lb = t.layer(l);
      KV_CHECK(static_cast<int64_t>(lb.blocks.size()) == blocks_for_tokens(lb.length, bs_),
               "sequence " << id << " layer " << l << " holds " << lb.blocks.size() << " blocks for " << lb.length
                           << " tokens");
      for (int32_t b : lb.blocks) {
        KV_CHECK(b >= 0 && b < alloc_.total_blocks(), "sequence " << id << " layer " << l << " has bad block " << b);
        ++refs[static_cast<size_t>(b)];
      }
    }
  }
  if (prefix_) {
    prefix_->check_invariants(contexts_ ? contexts_->host_slots_used() : 0);
    prefix_->count_refs(refs);
  }
  if (contexts_) {
    contexts_->check_invariants();
    contexts_->count_refs(refs);
  }
  if (tier_) tier_->check_invariants();
  // The device tables say what the host's say.
  dev_.flush();
  for (int64_t l = 0; l < num_layers_; ++l) {
    const torch::Tensor tab = dev_.tables(l).to(torch::kCPU).contiguous();
    const torch::Tensor len = dev_.lengths(l).to(torch::kCPU).contiguous();
    for (const auto& [id, t] : seqs_) {
      for (int64_t lane = 0; lane < lanes_; ++lane) {
        const int32_t row = dev_.row(row_key(id, lane));
        const LayerBlocks& lb = t.layer(slot(l, lane));
        const int32_t dev_len = len.data_ptr<int32_t>()[row];
        KV_CHECK(dev_len == lb.length, "sequence " << id << " layer " << l << " lane " << lane << ": device length "
                                                   << dev_len << " != " << lb.length);
        const int32_t* tp = tab.data_ptr<int32_t>() + int64_t{row} * tab.size(1);
        for (size_t i = 0; i < lb.blocks.size(); ++i) {
          KV_CHECK(tp[i] == lb.blocks[i], "sequence " << id << " layer " << l << ": device table entry " << i << " is "
                                                      << tp[i] << ", host " << lb.blocks[i]);
        }
      }
    }
  }
  for (int64_t b = 0; b < alloc_.total_blocks(); ++b) {
    KV_CHECK(refs[b] == alloc_.refcount(static_cast<int32_t>(b)),
             "block " << b << " referenced by " << refs[b] << " tables but refcount " << alloc_.refcount(static_cast<int32_t>(b)));
  }
}

}  // namespace kvserve
