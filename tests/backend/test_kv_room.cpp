// KvRoom: the room the scheduler plans a step against. One pool is one free count; formats on one
// slab storage each fill their own partly used slabs first and then take free slabs whole, so a
// format never sees another format's free blocks as room.
#include <gtest/gtest.h>

#include "backend/engine/kv_room.h"

namespace kvserve {
namespace {

TEST(KvRoom, OnePoolIsOneCountForEveryFormat) {
  KvRoom r(10);
  EXPECT_TRUE(r.fits(0, 10));
  EXPECT_FALSE(r.fits(0, 11));
  EXPECT_TRUE(r.fits({4, 6}));  // a policy's format index means nothing on one pool
  EXPECT_FALSE(r.fits({4, 7}));
  EXPECT_TRUE(r.draws_slabs(0, 1));
  r.take(1, 4);
  EXPECT_EQ(r.own(0), 6);
  r.give(0, 2);
  EXPECT_TRUE(r.fits(0, 8));
  r.take(0, 9);  // more than there is: short, and nothing fits
  EXPECT_FALSE(r.fits(0, 0 + 1));
  EXPECT_EQ(r.own(0), -1);
}

TEST(KvRoom, AFormatFillsItsOwnSlabsThenTakesWholeOnes) {
  // Slabs of 153 units (9 int8 blocks of 17, or 17 int4 blocks of 9): int8 has 2 blocks free in its
  // slabs, int4 3, and 2 slabs are free.
  KvRoom r({34, 27}, 2, 153);
  EXPECT_TRUE(r.fits(1, 27 + 2 * 153));
  EXPECT_FALSE(r.fits(1, 27 + 2 * 153 + 9));  // int8's free blocks are no room for int4
  EXPECT_FALSE(r.draws_slabs(1, 27));
  EXPECT_TRUE(r.draws_slabs(1, 36));
  // Both at once: int8 needs one slab beyond its own room, int4 one: fits; one more int4 slab: no.
  EXPECT_TRUE(r.fits({34 + 17, 27 + 153}));
  EXPECT_FALSE(r.fits({34 + 17, 27 + 153 + 9}));
  // int4 takes 4 blocks: its 3 and one of a new slab, whose other 16 blocks become its own.
  r.take(1, 36);
  EXPECT_EQ(r.free_slabs(), 1);
  EXPECT_EQ(r.own(1), 16 * 9);
  EXPECT_EQ(r.own(0), 34);
  EXPECT_FALSE(r.fits(0, 34 + 153 + 17));
  EXPECT_TRUE(r.fits(0, 34 + 153));
  // A release is room for its own format only.
  r.give(0, 17);
  EXPECT_TRUE(r.fits(0, 51 + 153));
  EXPECT_EQ(r.own(1), 16 * 9);
  r.take(0, 51 + 153);
  EXPECT_EQ(r.free_slabs(), 0);
  EXPECT_FALSE(r.fits(1, 16 * 9 + 9));
  EXPECT_TRUE(r.fits(1, 16 * 9));
}

}  // namespace
}  // namespace kvserve
