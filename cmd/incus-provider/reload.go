package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/bearer"
	"github.com/lightspeed-dev/incus-provider/targets"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// loadCatalog reads a templates file and checks it against this Incus: the
// power states the host can reach, each image, each placement. Start-up and
// every SIGHUP go through it, so a reload accepts exactly what a start would.
func loadCatalog(ctx context.Context, cfg config, client *incus.Client, server *incus.Server) (*templates.Catalog, error) {
	path := cfg.Templates
	catalog, err := templates.Load(path)
	if err != nil {
		return nil, badSetting(err)
	}
	if err := checkWarmMemory(catalog, cfg); err != nil {
		return nil, badSetting(err)
	}
	if err := catalog.CheckHost(templates.HostOf(server)); err != nil {
		return nil, badSetting(err)
	}
	if err := catalog.Resolve(ctx, client); err != nil {
		return nil, unlessRetryable(err)
	}
	if err := catalog.CheckPlacement(ctx, server.Environment.ServerClustered, client); err != nil {
		return nil, unlessRetryable(err)
	}
	return catalog, nil
}

// reloader holds what SIGHUP replaces: the templates, the controller's
// and the edge's TLS certificates, and the bearer credential.
// Connections are untouched: open ones keep their handshake and the
// credential they were admitted with, new ones get the new certificate
// and are checked against the new credential, and every method call after
// the swap sees the new templates.
type reloader struct {
	cfg        config
	client     *incus.Client
	server     *incus.Server
	targets    *targets.Service
	log        *zap.Logger
	credential bearer.Credential
	// level is the logger's, which PROVIDER_SETTINGS_FILE's
	// PROVIDER_LOG_LEVEL changes in place.
	level zap.AtomicLevel
	// peerSecrets are the forwarding secrets; nil without forwarding.
	peerSecrets *guest.PeerSecrets
	catalog     atomic.Pointer[templates.Catalog]
	cert        atomic.Pointer[tls.Certificate]
	edgeCert    atomic.Pointer[tls.Certificate]
}

func loadCert(cfg config) (*tls.Certificate, error) {
	cert, err := tls.LoadX509KeyPair(cfg.TLSCert, cfg.TLSKey)
	if err != nil {
		return nil, badSetting(fmt.Errorf("PROVIDER_TLS_CERT=%q / PROVIDER_TLS_KEY: not a usable pair: %w", cfg.TLSCert, err))
	}
	return &cert, nil
}

// tlsConfig serves whichever controller certificate was loaded last.
func (r *reloader) tlsConfig() *tls.Config { return servingLatest(&r.cert) }

// edgeTLSConfig serves whichever edge certificate was loaded last.
func (r *reloader) edgeTLSConfig() *tls.Config { return servingLatest(&r.edgeCert) }

// servingLatest is a TLS configuration whose every handshake gets the
// certificate cert holds at that moment.
func servingLatest(cert *atomic.Pointer[tls.Certificate]) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return cert.Load(), nil
		},
	}
}

// reload reads both again. Each part is replaced only when the new one is
// accepted whole; a refusal is logged as a sentence and the old one stays.
func (r *reloader) reload(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	catalog, err := loadCatalog(ctx, r.cfg, r.client, r.server)
	if err != nil {
		r.log.Error("SIGHUP: the templates file is refused; the templates loaded before stay in force", zap.String("file", r.cfg.Templates), zap.Error(err))
	} else {
		r.catalog.Store(catalog)
		r.targets.SetCatalog(catalog)
		r.log.Info("SIGHUP: templates reloaded", zap.String("file", r.cfg.Templates), zap.Strings("templates", templateIDs(catalog)))
	}
	if r.cfg.TLSCert != "" {
		if cert, err := loadCert(r.cfg); err != nil {
			r.log.Error("SIGHUP: the TLS certificate is refused; the one loaded before stays in force", zap.String("file", r.cfg.TLSCert), zap.Error(err))
		} else {
			r.cert.Store(cert)
			r.log.Info("SIGHUP: TLS certificate reloaded", zap.String("file", r.cfg.TLSCert))
		}
	}
	if r.cfg.edgeCert != nil {
		if cert, err := tls.LoadX509KeyPair(r.cfg.IngressTLSCert, r.cfg.IngressTLSKey); err != nil {
			r.log.Error("SIGHUP: the ingress TLS certificate is refused; the one loaded before stays in force", zap.String("file", r.cfg.IngressTLSCert), zap.Error(err))
		} else {
			r.edgeCert.Store(&cert)
			r.log.Info("SIGHUP: ingress TLS certificate reloaded", zap.String("file", r.cfg.IngressTLSCert))
		}
	}
	if r.cfg.SettingsFile != "" {
		r.reloadSettings()
	}
	if r.peerSecrets != nil {
		secrets, why := readPeerSecrets(r.cfg.PeerSecretFile)
		var err error
		if why == "" {
			err = r.peerSecrets.Set(secrets)
		} else {
			err = errors.New(why)
		}
		if err != nil {
			r.log.Error("SIGHUP: the peer secret file is refused; the secrets loaded before stay in force", zap.String("file", r.cfg.PeerSecretFile), zap.Error(err))
		} else {
			r.log.Info("SIGHUP: peer secrets reloaded", zap.String("file", r.cfg.PeerSecretFile), zap.Int("secrets", len(secrets)))
		}
	}
	if r.cfg.CredentialFile != "" {
		// The file only: never the secret, nor a digest of it, in a log.
		if err := r.credential.Reload(r.cfg.CredentialFile); err != nil {
			r.log.Error("SIGHUP: the credential file is refused; the credential loaded before stays in force", zap.String("file", r.cfg.CredentialFile), zap.Error(err))
		} else {
			r.log.Info("SIGHUP: credential reloaded", zap.String("file", r.cfg.CredentialFile))
		}
	}
}

// watch reloads on each signal until ctx ends.
func (r *reloader) watch(ctx context.Context, hup <-chan os.Signal) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
			r.reload(ctx)
		}
	}
}

func templateIDs(c *templates.Catalog) []string {
	ids := make([]string, 0, len(c.All()))
	for _, t := range c.All() {
		ids = append(ids, t.Wire.TemplateID)
	}
	return ids
}

// checkWarmMemory refuses, with PROVIDER_WARM_MEMORY_MAX set, a pool the
// ceiling cannot count (a template with no resources.memoryBytes) or whose
// minimum alone exceeds it.
func checkWarmMemory(catalog *templates.Catalog, cfg config) error {
	ceiling := cfg.warmMemoryMaxBytes
	if ceiling <= 0 {
		return nil
	}
	for _, t := range catalog.All() {
		if !t.Pooled() {
			continue
		}
		r := t.Wire.Resources
		if r == nil || r.MemoryBytes == nil {
			return fmt.Errorf("templates file %s: template %q keeps a warm pool and states no resources.memoryBytes, which PROVIDER_WARM_MEMORY_MAX counts each warm instance at; state it, or set PROVIDER_WARM_MEMORY_MAX=off", cfg.Templates, t.Wire.TemplateID)
		}
		if need := int64(t.Warm) * int64(*r.MemoryBytes); need > ceiling {
			return fmt.Errorf("templates file %s: template %q's minimum pool (warm %d of %d bytes) holds more than PROVIDER_WARM_MEMORY_MAX (%s)", cfg.Templates, t.Wire.TemplateID, t.Warm, *r.MemoryBytes, cfg.WarmMemoryMax)
		}
	}
	return nil
}
