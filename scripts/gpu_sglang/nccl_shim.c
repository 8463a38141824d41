/* The NCCL calls torch 2.14.1 binds that the GPU machine's NCCL 2.28.9 lacks.
 *
 * libtorch_cuda.so is linked against NCCL 2.30 and will not load without these symbols
 * ("undefined symbol: ncclCommResume"). Preloaded (LD_PRELOAD) beside the machine's own
 * NCCL, they let torch load without carrying NCCL 2.30.7 (216 MB, four relay pieces);
 * each answers ncclInvalidUsage, and none is called by a one-GPU server (communicator
 * suspend/resume/grow, symmetric-memory windows and signals, per-communicator memory
 * stats). The list: `nm -D --undefined-only` of torch's libraries against the
 * defined symbols of NCCL 2.28.9. Built with no C library: it needs nothing. */
#define NCCL_INVALID_USAGE 5
#define STUB(name) int name(void) { return NCCL_INVALID_USAGE; }
STUB(ncclCommGetUniqueId)
STUB(ncclCommGrow)
STUB(ncclCommMemStats)
STUB(ncclCommResume)
STUB(ncclCommSuspend)
STUB(ncclGetLsaMultimemDevicePointer)
STUB(ncclGetPeerDevicePointer)
STUB(ncclPutSignal)
STUB(ncclSignal)
STUB(ncclWaitSignal)
STUB(ncclWinGetUserPtr)
