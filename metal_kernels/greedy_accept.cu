// Greedy acceptance over a candidate tree, CUDA body for mx.fast.cuda_kernel (MLX writes the
// signature). Line-for-line twin of greedy_accept.metal: only the thread index, shared-memory
// and barrier spellings differ.
// Inputs tokens (TN) int32: the nodes' tokens; rows (R, W) int32: the nodes of each
// root-to-leaf row, padded with -1; best (TN): the target's argmax at each node. A row accepts
// its drafts while each node's token is the argmax at the node before it.
// Outputs info (2 + 2W) int32: the accepted drafts n, the next token (the argmax at the path's
// last node), the best row's nodes and their tokens (tokens[0] for padding); last (1) int32:
// the path's last node. Template: TB (best's dtype). One threadgroup of 32 threads: thread i
// scores rows i, i + 32, ...; thread 0 takes the longest, the first row on ties (as argmax).
const int i = threadIdx.x;
const int R = rows_shape[0];
const int W = rows_shape[1];
__shared__ int lens[32];
__shared__ int at[32];
int bn = -1;
int br = 0;
for (int r = i; r < R; r += 32) {
  int n = 0;
  while (n + 1 < W && rows[r * W + n + 1] >= 0 && tokens[rows[r * W + n + 1]] == static_cast<int>(best[rows[r * W + n]])) {
    ++n;
  }
  if (n > bn) {
    bn = n;
    br = r;
  }
}
lens[i] = bn;
at[i] = br;
__syncthreads();
if (i == 0) {
  for (int j = 1; j < 32; ++j) {
    if (lens[j] > bn || (lens[j] == bn && at[j] < br)) {
      bn = lens[j];
      br = at[j];
    }
  }
  const int tail = rows[br * W + bn];
  info[0] = bn;
  info[1] = static_cast<int>(best[tail]);
  for (int j = 0; j < W; ++j) {
    const int node = rows[br * W + j];
    info[2 + j] = node;
    info[2 + W + j] = tokens[node < 0 ? 0 : node];
  }
  last[0] = tail;
}
