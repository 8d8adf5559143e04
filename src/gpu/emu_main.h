// The emulator's block scheduler and entry point (appended after the kernel
// source and its kernel table `emu_kernels`, see src/gpu/emu.rs).
//
// Usage: emu ARENA BASE LAUNCHES
//   ARENA     file mapped at address BASE (hex), read and written
//   LAUNCHES  text, one launch per line:
//             NAME GRID THREADS SMEM SHAPE A0 A1 [B C ...]
//             SHAPE 0: (descs, work, status)              A0 A1 STATUS
//             SHAPE 1: (descs, work, u32, status)         A0 A1 U STATUS
//             SHAPE 2: (descs, work, u32, f32, status)    A0 A1 H CBITS STATUS
//             SHAPE 3: (descs, work, u32, u32, f32, st.)  A0 A1 B H CBITS STATUS

static void (*emu_run_fn)();
static void emu_entry() {
    emu_run_fn();
    EmuThread* t = emu_cur;
    t->done = true;
    emu_live--;
    EmuWarp& w = emu_warps[t->tid.x / 32];
    w.live--;
    if (emu_bar_count > 0 && emu_bar_count >= emu_live) {
        emu_bar_count = 0;
        emu_bar_gen++;
    }
    if (w.count > 0 && w.count >= w.live) {
        w.count = 0;
        w.gen++;
    }
    swapcontext(&t->ctx, &emu_main);
}

static const size_t EMU_STACK = 256 * 1024;

static void emu_block(unsigned threads) {
    if (emu_threads.size() < threads) {
        size_t old = emu_threads.size();
        emu_threads.resize(threads);
        for (size_t i = old; i < threads; i++) emu_threads[i].stack = (char*)malloc(EMU_STACK);
    }
    emu_warps.assign((threads + 31) / 32, EmuWarp{});
    for (unsigned i = 0; i < threads; i++) {
        EmuThread& t = emu_threads[i];
        t.tid = dim3{i, 0, 0};
        t.done = false;
        t.waiting = false;
        getcontext(&t.ctx);
        t.ctx.uc_stack.ss_sp = t.stack;
        t.ctx.uc_stack.ss_size = EMU_STACK;
        t.ctx.uc_link = nullptr;
        makecontext(&t.ctx, emu_entry, 0);
        emu_warps[i / 32].live++;
    }
    emu_live = (int)threads;
    emu_bar_count = 0;
    emu_bar_gen = 0;
    int strikes = 0;
    while (emu_live > 0) {
        unsigned gen_before = emu_bar_gen;
        unsigned long long wgen = 0;
        for (auto& w : emu_warps) wgen += w.gen;
        bool all_waiting = true;
        for (unsigned i = 0; i < threads; i++) {
            EmuThread& t = emu_threads[i];
            if (t.done) continue;
            emu_cur = &t;
            swapcontext(&emu_main, &t.ctx);
            if (!t.done && !t.waiting) all_waiting = false;
            if (t.done) all_waiting = false;
        }
        unsigned long long wgen2 = 0;
        for (auto& w : emu_warps) wgen2 += w.gen;
        if (emu_live > 0 && all_waiting && gen_before == emu_bar_gen && wgen == wgen2) {
            // Every live thread waits and no barrier moved: a few rounds of
            // that is a deadlock (a barrier or shuffle not reached by all).
            if (++strikes > 3) {
                fprintf(stderr, "emu: deadlock in block %u (divergent barrier or shuffle)\n", emu_block_idx.x);
                exit(3);
            }
        } else {
            strikes = 0;
        }
    }
}

int main(int argc, char** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s ARENA BASE LAUNCHES\n", argv[0]);
        return 2;
    }
    int fd = open(argv[1], O_RDWR);
    if (fd < 0) {
        perror("arena");
        return 2;
    }
    struct stat st;
    fstat(fd, &st);
    void* base = (void*)strtoull(argv[2], nullptr, 16);
    void* p = mmap(base, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED_NOREPLACE, fd, 0);
    if (p != base) {
        perror("mmap arena");
        return 2;
    }
    FILE* lf = fopen(argv[3], "r");
    if (!lf) {
        perror("launches");
        return 2;
    }
    char name[256];
    unsigned grid, threads, smem, shape;
    while (fscanf(lf, "%255s %u %u %u %u", name, &grid, &threads, &smem, &shape) == 5) {
        unsigned long long a[6] = {0, 0, 0, 0, 0, 0};
        int nargs = shape == 0 ? 3 : shape == 1 ? 4 : shape == 2 ? 5 : 6;
        for (int i = 0; i < nargs; i++) fscanf(lf, "%llx", &a[i]);
        void* fn = nullptr;
        for (const EmuKernel* k = emu_kernels; k->name; k++)
            if (strcmp(k->name, name) == 0) fn = k->fn;
        if (!fn) {
            fprintf(stderr, "emu: no kernel %s in this source\n", name);
            return 4;
        }
        static void* f;
        static unsigned long long args[6];
        static unsigned sh;
        f = fn;
        sh = shape;
        memcpy(args, a, sizeof(a));
        emu_run_fn = []() {
            typedef void* P;
            unsigned long long* x = args;
            float c2, c3;
            memcpy(&c2, &x[3], 4);
            memcpy(&c3, &x[4], 4);
            switch (sh) {
                case 0: ((void (*)(P, P, P))f)((P)x[0], (P)x[1], (P)x[2]); break;
                case 1: ((void (*)(P, P, unsigned, P))f)((P)x[0], (P)x[1], (unsigned)x[2], (P)x[3]); break;
                case 2: ((void (*)(P, P, unsigned, float, P))f)((P)x[0], (P)x[1], (unsigned)x[2], c2, (P)x[4]); break;
                default:
                    ((void (*)(P, P, unsigned, unsigned, float, P))f)((P)x[0], (P)x[1], (unsigned)x[2], (unsigned)x[3], c3,
                                                                    (P)x[5]);
                    break;
            }
        };
        emu_smem.assign(smem + 16, 0);
        emu_block_dim = dim3{threads, 1, 1};
        for (unsigned b = 0; b < grid; b++) {
            emu_block_idx = dim3{b, 0, 0};
            emu_block(threads);
        }
    }
    fclose(lf);
    msync(base, (size_t)st.st_size, MS_SYNC);
    munmap(base, (size_t)st.st_size);
    close(fd);
    return 0;
}
