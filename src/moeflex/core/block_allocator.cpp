#include "moeflex/core/block_allocator.h"

#include <algorithm>
#include <fmt/format.h>

namespace moeflex {

BlockAllocator::BlockAllocator(Bytes capacity, Bytes alignment) : alignment_(alignment) {
  if (alignment <= 0 || (alignment & (alignment - 1)) != 0)
    throw ConfigError(fmt::format("allocator alignment must be a power of two (got {} B)", alignment));
  capacity_ = capacity / alignment * alignment;
  if (capacity_ <= 0)
    throw ConfigError(fmt::format("memory budget must hold at least one {} B block (got {} B)", alignment,
                                  capacity));
  blocks_[0] = {capacity_, true};
  free_.insert({capacity_, 0});
}

Bytes BlockAllocator::round_up(Bytes bytes) const {
  const Bytes b = bytes < 1 ? 1 : bytes;
  return (b + alignment_ - 1) / alignment_ * alignment_;
}

Bytes BlockAllocator::allocate(Bytes bytes, MemCategory category, std::string_view op, bool from_top) {
  const Bytes size = round_up(bytes);
  auto it = free_.lower_bound({size, 0});
  if (it == free_.end())
    throw OutOfMemoryError(size, capacity_ - in_use(), largest_free_block(), capacity_, category,
                           std::string(op));
  Bytes offset = 0;
  if (category == MemCategory::workspace || from_top) {
    // Short-lived blocks: the top end of the highest free block that fits, so
    // transients do not leave holes between the long-lived blocks growing from below.
    auto top = blocks_.rbegin();
    while (top != blocks_.rend() && !(top->second.second && top->second.first >= size)) ++top;
    offset = top->first + top->second.first - size;  // exists: `it` fits somewhere
    take(top->first, offset, size, category);
  } else {
    offset = it->second;
    take(it->second, offset, size, category);
  }
  return offset;
}

void BlockAllocator::allocate_at(Bytes offset, Bytes bytes, MemCategory category) {
  const Bytes size = round_up(bytes);
  auto it = blocks_.upper_bound(offset);
  if (offset % alignment_ != 0 || it == blocks_.begin())
    throw Error(fmt::format("arena: cannot reserve {} B at offset {}", size, offset));
  --it;
  if (!it->second.second || offset + size > it->first + it->second.first)
    throw Error(fmt::format("arena: cannot reserve {} B at offset {}: not inside a free block", size, offset));
  take(it->first, offset, size, category);
}

void BlockAllocator::take(Bytes block_offset, Bytes offset, Bytes size, MemCategory category) {
  const Bytes block_size = blocks_.at(block_offset).first;
  free_.erase({block_size, block_offset});
  if (offset > block_offset) {
    blocks_[block_offset] = {offset - block_offset, true};
    free_.insert({offset - block_offset, block_offset});
  }
  blocks_[offset] = {size, false};
  const Bytes end = offset + size, block_end = block_offset + block_size;
  if (block_end > end) {
    blocks_[end] = {block_end - end, true};
    free_.insert({block_end - end, end});
  }
  stats_.account(category, size);
  // Fragmentation: bytes free below the highest used block's end.
  auto last_used = blocks_.rbegin();
  while (last_used != blocks_.rend() && last_used->second.second) ++last_used;
  if (last_used != blocks_.rend()) {
    const Bytes used_end = last_used->first + last_used->second.first;
    frag_peak_ = std::max(frag_peak_, used_end - in_use());
  }
}

void BlockAllocator::deallocate(Bytes offset, Bytes bytes, MemCategory category) {
  const Bytes size = round_up(bytes);
  auto it = blocks_.find(offset);
  if (it == blocks_.end() || it->second.second || it->second.first != size)
    throw Error(fmt::format("arena: invalid free of {} B at offset {}", size, offset));
  stats_.account(category, -size);
  it->second.second = true;
  Bytes bsize = size;
  // Coalesce with the next block.
  auto next = std::next(it);
  if (next != blocks_.end() && next->second.second) {
    free_.erase({next->second.first, next->first});
    bsize += next->second.first;
    blocks_.erase(next);
  }
  // Coalesce with the previous block.
  if (it != blocks_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.second) {
      free_.erase({prev->second.first, prev->first});
      bsize += prev->second.first;
      blocks_.erase(it);
      it = prev;
      offset = prev->first;
    }
  }
  it->second = {bsize, true};
  free_.insert({bsize, offset});
}

std::vector<BlockMove> BlockAllocator::compact(const std::function<bool(Bytes offset)>& movable) {
  std::vector<BlockMove> moves;
  std::map<Bytes, std::pair<Bytes, bool>> blocks;
  std::set<std::pair<Bytes, Bytes>> free_blocks;
  auto add_free = [&](Bytes from, Bytes to) {
    if (to <= from) return;
    blocks[from] = {to - from, true};
    free_blocks.insert({to - from, from});
  };
  Bytes cursor = 0;  // lowest free offset of the current stretch
  for (const auto& [offset, block] : blocks_) {
    const auto [size, is_free] = block;
    if (is_free) continue;
    if (movable(offset)) {
      if (cursor < offset) moves.push_back({offset, cursor, size});
      blocks[cursor] = {size, false};
      cursor += size;
    } else {
      add_free(cursor, offset);
      blocks[offset] = {size, false};
      cursor = offset + size;
    }
  }
  add_free(cursor, capacity_);
  blocks_ = std::move(blocks);
  free_ = std::move(free_blocks);
  return moves;
}

std::vector<BlockAllocator::Block> BlockAllocator::layout() const {
  std::vector<Block> out;
  out.reserve(blocks_.size());
  for (const auto& [offset, block] : blocks_) out.push_back({offset, block.first, block.second});
  return out;
}

}  // namespace moeflex
