from prismgate.cli import main; import sys; sys.exit(main())
