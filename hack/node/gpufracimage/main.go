// Command gpufracimage builds gpufrac's container image without a container
// engine, as an OCI image layout in one tar archive (`make image`):
//
//	/usr/local/bin/gpufrac                      the one binary (cgo: go-nvml)
//	/usr/local/lib/gpufrac/libnvidia-ml.so.1    the nvidia-smi view library
//	/lib/<triplet>/…, the ELF interpreter       the C library both need, from this machine
//	/etc/passwd, /etc/group                     root and nonroot (65532)
//
// No shell and no package manager: the node agent's init container runs
// `gpufrac hook install`. The default user is 65532 (the scheduler, the
// webhook and the dashboard run as it; the node agent's containers set root
// for the root-owned runtime and kubelet sockets). The NVIDIA driver's own
// libnvidia-ml.so.1 and nvidia-cuda-mps-control are not in the image: the
// NVIDIA runtime injects them into the node agent's pod.
//
// Reproducible: every file's time is the commit's, entries are sorted, no
// owner names; the same commit, Go toolchain and C library give the same
// digest, which the image's labels name.
//
// Usage: gpufracimage -binary B -library L -ref REF -revision SHA -created UNIX -out DIR
package main

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// triplets are Debian's multiarch directories of the C library.
var triplets = map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}

// extraLibs are libraries of the C library that neither gpufrac nor the
// view library links but NVIDIA's libnvidia-ml.so.1, which the NVIDIA
// runtime injects into the node agent's container, does (DT_NEEDED of the
// r5xx driver's library: libpthread, libdl, libm, librt).
var extraLibs = []string{"libpthread.so.0", "libdl.so.2", "libm.so.6", "librt.so.1"}

func main() {
	var o options
	flag.StringVar(&o.binary, "binary", "", "the gpufrac binary")
	flag.StringVar(&o.library, "library", "", "the nvidia-smi view library (libnvidia-ml.so.1)")
	flag.StringVar(&o.license, "license", "LICENSE", "gpufrac's license")
	flag.StringVar(&o.ref, "ref", "", "the image's name, e.g. ghcr.io/gpufrac/gpufrac:0.2.0")
	flag.StringVar(&o.revision, "revision", "", "the commit the binary was built from")
	flag.Int64Var(&o.created, "created", 0, "the commit's time (seconds since 1970): every file's time and the image's")
	flag.StringVar(&o.libDir, "libc-dir", "", "where the C library is (default /lib/<triplet>)")
	flag.StringVar(&o.out, "out", "", "directory for the OCI layout (OUT/oci) and archive (OUT/gpufrac.oci.tar)")
	flag.Parse()
	if o.binary == "" || o.library == "" || o.ref == "" || o.revision == "" || o.out == "" || o.created == 0 {
		fmt.Fprintln(os.Stderr, "usage: gpufracimage -binary B -library L -ref REF -revision SHA -created UNIX -out DIR")
		os.Exit(2)
	}
	digest, err := build(o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gpufracimage:", err)
		os.Exit(1)
	}
	fmt.Println(digest)
}

type options struct {
	binary, library, license, ref, revision, libDir, out string
	created                                              int64
}

// file is one entry of the image's only layer.
type file struct {
	name     string // without the leading slash
	mode     int64
	data     []byte
	linkname string // a symlink when set
	dir      bool
	owner    int // uid and gid
}

func build(o options) (string, error) {
	arch := runtime.GOARCH
	triplet, ok := triplets[arch]
	if !ok {
		return "", fmt.Errorf("no C library layout known for %s", arch)
	}
	if o.libDir == "" {
		o.libDir = "/lib/" + triplet
	}
	tag, err := name.NewTag(o.ref)
	if err != nil {
		return "", fmt.Errorf("-ref %q: %w", o.ref, err)
	}
	var files []file
	add := func(name string, mode int64, src string) error {
		data, err := os.ReadFile(src)
		if err != nil {
			return err
		}
		files = append(files, file{name: name, mode: mode, data: data})
		return nil
	}
	if err := add("usr/local/bin/gpufrac", 0o755, o.binary); err != nil {
		return "", err
	}
	if err := add("usr/local/lib/gpufrac/libnvidia-ml.so.1", 0o644, o.library); err != nil {
		return "", err
	}
	if err := add("usr/share/doc/gpufrac/LICENSE", 0o644, o.license); err != nil {
		return "", err
	}
	// The C library: what the two ELF files need, and what the driver's
	// NVML needs, from this machine's libc6 with its copyright notice.
	interp, needed, err := elfNeeds(o.binary, o.library)
	if err != nil {
		return "", err
	}
	libs := slices.Sorted(slices.Values(append(needed, extraLibs...)))
	libs = slices.Compact(libs)
	for _, lib := range libs {
		src, err := filepath.EvalSymlinks(filepath.Join(o.libDir, lib))
		if err != nil {
			return "", fmt.Errorf("the C library's %s: %w", lib, err)
		}
		if err := add(filepath.Join("lib", triplet, lib), 0o755, src); err != nil {
			return "", err
		}
	}
	// The interpreter at the path the binaries name (/lib64/ld-linux-x86-64.so.2),
	// a link to its file beside the other libraries, as in Debian.
	interpName := filepath.Base(interp)
	src, err := filepath.EvalSymlinks(interp)
	if err != nil {
		return "", fmt.Errorf("the ELF interpreter %s: %w", interp, err)
	}
	if err := add(filepath.Join("lib", triplet, interpName), 0o755, src); err != nil {
		return "", err
	}
	if filepath.Dir(interp) != "/lib/"+triplet {
		files = append(files, file{name: strings.TrimPrefix(interp, "/"), linkname: "/lib/" + triplet + "/" + interpName})
	}
	if err := add("usr/share/doc/libc6/copyright", 0o644, "/usr/share/doc/libc6/copyright"); err != nil {
		return "", err
	}
	files = append(files,
		file{name: "etc/passwd", mode: 0o644, data: []byte("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n")},
		file{name: "etc/group", mode: 0o644, data: []byte("root:x:0:\nnonroot:x:65532:\n")},
		file{name: "tmp", mode: 0o1777, dir: true},
		// The default user's home, its own: a client looking for
		// ~/.kube/config must find nothing there, not be refused.
		file{name: "home/nonroot", mode: 0o700, dir: true, owner: 65532},
	)
	created := time.Unix(o.created, 0).UTC()
	layer, err := layerOf(files, created)
	if err != nil {
		return "", err
	}
	// OCI media types throughout (empty.Image is Docker's schema 2).
	base := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return "", err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return "", err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Created = "linux", arch, v1.Time{Time: created}
	libcVersion := libcPackageVersion()
	cf.Config = v1.Config{
		User:       "65532:65532",
		Entrypoint: []string{"/usr/local/bin/gpufrac"},
		Env:        []string{"PATH=/usr/local/bin:/usr/bin:/bin"},
		WorkingDir: "/",
		Labels: map[string]string{
			"org.opencontainers.image.title":       "gpufrac",
			"org.opencontainers.image.description": "GPU fractions with an enforced memory share for Kubernetes: scheduler, webhook, node agent, hook",
			"org.opencontainers.image.source":      "https://github.com/gpufrac/gpufrac",
			"org.opencontainers.image.licenses":    "Apache-2.0",
			"org.opencontainers.image.version":     tag.TagStr(),
			"org.opencontainers.image.revision":    o.revision,
			"org.opencontainers.image.created":     created.Format(time.RFC3339),
			// What else decides the digest besides the commit.
			"io.gpufrac.image.go":   runtime.Version(),
			"io.gpufrac.image.libc": libcVersion,
		},
	}
	cf.History = []v1.History{{Created: v1.Time{Time: created}, CreatedBy: "hack/node/gpufracimage (make image)", Comment: "gpufrac, its view library and the C library"}}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return "", err
	}
	digest, err := img.Digest()
	if err != nil {
		return "", err
	}
	// The layout directory (crane push OUT/oci, skopeo copy oci:OUT/oci)
	// and one archive of it (ctr images import, skopeo copy oci-archive:).
	dir := filepath.Join(o.out, "oci")
	if err := os.RemoveAll(dir); err != nil {
		return "", err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return "", err
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": tag.TagStr(),
		// As containerd and the kubelet name it: docker.io, not
		// go-containerregistry's index.docker.io, for a short name.
		"io.containerd.image.name": strings.Replace(tag.Name(), name.DefaultRegistry+"/", "docker.io/", 1),
	})); err != nil {
		return "", err
	}
	if err := tarDir(dir, filepath.Join(o.out, "gpufrac.oci.tar"), created); err != nil {
		return "", err
	}
	return digest.String(), nil
}

// elfNeeds is the interpreter and the DT_NEEDED libraries of the files.
func elfNeeds(paths ...string) (interp string, needed []string, err error) {
	for _, p := range paths {
		f, err := elf.Open(p)
		if err != nil {
			return "", nil, err
		}
		libs, err := f.ImportedLibraries()
		if err != nil {
			_ = f.Close()
			return "", nil, fmt.Errorf("%s: %w", p, err)
		}
		needed = append(needed, libs...)
		for _, prog := range f.Progs {
			if prog.Type == elf.PT_INTERP {
				b, err := io.ReadAll(prog.Open())
				if err != nil {
					_ = f.Close()
					return "", nil, err
				}
				interp = strings.TrimRight(string(b), "\x00")
			}
		}
		_ = f.Close()
	}
	if interp == "" {
		return "", nil, fmt.Errorf("%s has no ELF interpreter: build it with cgo (go-nvml loads the driver's library)", paths[0])
	}
	return interp, needed, nil
}

// libcPackageVersion is the Debian version of the C library copied in.
func libcPackageVersion() string {
	b, err := os.ReadFile("/var/lib/dpkg/status")
	if err != nil {
		return "unknown"
	}
	for _, para := range strings.Split(string(b), "\n\n") {
		if strings.HasPrefix(para, "Package: libc6\n") {
			for _, line := range strings.Split(para, "\n") {
				if v, ok := strings.CutPrefix(line, "Version: "); ok {
					return "glibc (Debian libc6 " + v + ")"
				}
			}
		}
	}
	return "unknown"
}

// layerOf writes the files, their parent directories first and everything
// sorted, into one uncompressed-then-gzipped layer with fixed times.
func layerOf(files []file, mtime time.Time) (v1.Layer, error) {
	dirs := map[string]bool{}
	for _, f := range files {
		for d := filepath.Dir(f.name); d != "."; d = filepath.Dir(d) {
			dirs[d] = true
		}
	}
	for _, f := range files {
		if f.dir {
			delete(dirs, f.name)
		}
	}
	for d := range dirs {
		files = append(files, file{name: d, mode: 0o755, dir: true})
	}
	slices.SortFunc(files, func(a, b file) int { return strings.Compare(a.name, b.name) })
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		h := &tar.Header{Name: f.name, Mode: f.mode, ModTime: mtime, Format: tar.FormatPAX, Uid: f.owner, Gid: f.owner}
		switch {
		case f.dir:
			h.Typeflag, h.Name = tar.TypeDir, f.name+"/"
		case f.linkname != "":
			h.Typeflag, h.Linkname, h.Mode = tar.TypeSymlink, f.linkname, 0o777
		default:
			h.Typeflag, h.Size = tar.TypeReg, int64(len(f.data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	data := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil },
		tarball.WithMediaType(types.OCILayer))
}

// tarDir archives the OCI layout with fixed times and sorted entries, so
// that the archive is as reproducible as the image.
func tarDir(dir, out string, mtime time.Time) error {
	var names []string
	if err := filepath.WalkDir(dir, func(p string, _ fs.DirEntry, err error) error {
		if err == nil && p != dir {
			names = append(names, p)
		}
		return err
	}); err != nil {
		return err
	}
	slices.Sort(names)
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	for _, p := range names {
		fi, err := os.Stat(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		h := &tar.Header{Name: filepath.ToSlash(rel), Mode: 0o644, ModTime: mtime, Format: tar.FormatPAX}
		if fi.IsDir() {
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, h.Name+"/", 0o755
			if err := tw.WriteHeader(h); err != nil {
				return err
			}
			continue
		}
		h.Typeflag, h.Size = tar.TypeReg, fi.Size()
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		src, err := os.Open(p)
		if err != nil {
			return err
		}
		_, err = io.Copy(tw, src)
		_ = src.Close()
		if err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}
